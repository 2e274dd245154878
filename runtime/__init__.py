"""What both worker actors are built from, outside the model engine: the engine on its own thread
bridged to asyncio (`engine_loop`), the CPUs a process may use (`cpus`), start-up with threads =
granted CPUs and the worker's description (`startup`), lending idle cores (`cores`), load reports
with telemetry (`telemetry`), and the test fault points (`parking`)."""
