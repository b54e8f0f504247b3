"""The process runtime: which process this is, when it goes away, which port is its own, what runs
when it starts, and the one recipe that builds its providers.

* :mod:`.identity`: the resource attributes that tell one serving process from another (role, pid,
  host, instance id, the ranks an engine adapter reports), re-labelling when a process learns its
  role late, and after ``fork``;
* :mod:`.lifecycle`: the bounded final flush on every orderly exit, the early flush when shutdown
  begins, and the flush handshake between a frontend and the engine processes it stops;
* :mod:`.ports`: which port each process of a topology serves Prometheus and ``/healthz`` on, and
  when a frontend binds;
* :mod:`.bootstrap`: callbacks at the bootstrap of a child ``multiprocessing`` spawned or forked;
* :mod:`.forks`: threads restarted in a forked child (a leaf: the GPU and signals parts use it);
* :mod:`.providers`: the one recipe for this process's tracer and meter providers.

It sits above the export part and the core, below the engine adapters (docs/architecture.md):
adapters report what they know about their process (role, ranks, start, exit) to it; it hands
export objects to the providers it builds.
"""
