"""The Checkpointer's local tier: node-local saves replicated to peer nodes over the peer
link, committed per step, and recovered from when a node is lost."""
