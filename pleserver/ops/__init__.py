"""The operator's side: doctor, plan, the command line's settings flags, deploy files, systemd."""
