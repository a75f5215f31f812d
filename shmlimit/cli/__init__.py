"""The command-line tools: the `shmlimit` command, top, doctor, metrics."""
