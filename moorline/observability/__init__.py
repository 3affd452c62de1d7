"""What operators watch: Prometheus metrics (:mod:`.metrics`) and structured logs (:mod:`.logs`).

It sits just above the settings, so every layer (the worker, the reaper, admission, the API)
can count and log through it without importing each other.
"""
