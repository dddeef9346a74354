"""What travels, as plain data both sides derive alike: the bucket plan (:mod:`.plan`), how a
payload is cut on the wire (:mod:`.segments`), tied weights sent once (:mod:`.aliases`),
self-describing buckets (:mod:`.described`) and sparse deltas (:mod:`.delta`). A layout
imports no transport, round or side."""
