"""Sizing the pools to an SLO (issue #30): measure (`profiler`), model (`simulator`), search
(`search`).

- `profile`: the measured costs as data (`Profile`), read and written as JSON, interpolated.
- `profiler`: `pdserve profile`: the engine's prefill and decode steps, the KV handoff, the router's
  per-token CPU, timed on this machine.
- `handoff_probe`: the KV handoff between two Ray actors over a real transport.
- `workload`: arrivals and request lengths (`Workload`), drawn with a fixed seed.
- `shape`: a system's configuration as the simulator and planner see it (`SystemShape`).
- `simulator`: `pdserve simulate`: a discrete-event model of the router and its workers.
- `report`: percentiles, goodput and utilisation of a simulated run.
- `search`: `pdserve plan`: the cheapest shape meeting the SLO at a rate, or the highest rate a
  size holds.

Torch-free at import: only `profiler` and `handoff_probe` use torch and Ray, lazily.
"""
