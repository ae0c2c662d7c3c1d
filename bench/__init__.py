"""Stopline's benchmark (``python -m bench``, bench/__main__.py lists its commands).

* ``drivers/``: what the benchmark asks of a server (``base.py``), for Stopline and for llama-server;
* ``scenarios.py``: each measurement, written once over the drivers; ``run.py`` runs them on every server;
* ``report.py``: the tables, the chart and RESULTS.md, from one result schema;
* ``inprocess/``: the engines' loops measured in-process, and the microbenchmarks (``pytest bench/``);
* ``tools/``: measurements against a Stopline of their own (one user and two, a flood of wrong keys);
* ``servers/``: the server process the benchmark measures Stopline in, its baseline engine, redis-server;
* ``launch.py``: the one way the tests and the benchmark start a server process.
"""
