"""Not the daemon: synthetic checkpoints, a launcher and the demo (tests, bench, the demo)."""
