"""A load: reading a committed checkpoint's records into a caller's tensors (resharding
where the layouts differ), whole-tree loads, and inspection. It imports nothing from the
save."""
