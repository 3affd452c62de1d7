"""Runs the workloads through one peer; executed by the peers' own venv, not Moorline's.

    bench/peers/.venv/bin/python bench/peers/peer_driver.py PEER STORAGE CONFIG_JSON

``PEER`` names a module ``peer_<PEER>.py`` here (``celery``, ``procrastinate``, ``pgqueuer``,
``dbos``, ``huey``); ``STORAGE`` is the peer's storage (``redis``, ``postgresql``, ``sqlite``);
``CONFIG_JSON`` is :mod:`run`'s shape. Prints one JSON object of figures as its last line.
"""

import importlib
import json
import sys

if __name__ == "__main__":
    peer, storage, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    module = importlib.import_module(f"peer_{peer.split('-')[0]}")
    print(json.dumps(module.run(peer, storage, config)))
