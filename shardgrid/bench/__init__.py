"""`shardgrid bench`: the load generator and its report (run.py is the entry point; ARCHITECTURE.md)."""
