"""What a checkpoint directory is: its file names, slipstream's index, the record format
of its data files, and what may be unpickled from it. The save and the load both stand on
this; it imports neither."""
