"""The latency ladder of torch.distributed collectives (resident beside gloo, NCCL, ...).

Modules, by job: ``cli`` (the command line, ``python -m resident_pg.bench``), ``ladder`` (the
parent: plans a run, launches one set of rank processes per group, collects rows), ``rank``
(the rank processes: devices, eager and graph modes, timing of a cell), ``ops`` (each op with its
correctness check), ``report`` (rows, tables, metadata, JSON), ``cuda`` (CUDA devices, graphs,
floors and targets), ``common`` (parsing and formatting helpers), ``interference`` (a
communicator beside a decode GEMM, ``python -m resident_pg.bench.interference``; its rank
processes in ``interference_rank``, its table and JSON in ``interference_report``).
``benchmarks/conftest.py`` runs the same ladder as pytest cases. Importing this package imports
none of them.
"""
