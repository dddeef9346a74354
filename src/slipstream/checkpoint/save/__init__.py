"""A save: what a rank saves (layout), the plan, staging into host memory, writing the data
files, and the commit, coordinated between ranks through the job's store."""
