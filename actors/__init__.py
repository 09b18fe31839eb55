"""The Ray shells: NumaWorker, Router, Scheduler, AdapterCache actors, the Client, and serve/connect."""
