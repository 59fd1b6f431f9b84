"""The scaffold the benchmarks share, one concept a module:

- ``checkout``: where the checkout is, and how a command keeps its packages
  out of the way of the installed ones;
- ``provenance``: the machine, the commit, and the CPU others used meanwhile;
- ``servers``: a synthetic checkpoint and a ``pleserver serve`` to time;
- ``load``: the bystander whose latency is the result, and the helper
  processes (flooders, submitters, attackers) that load the server beside it;
- ``scaffold``: the command line, the work directory and its clean-up, the
  JSON and the footer."""
