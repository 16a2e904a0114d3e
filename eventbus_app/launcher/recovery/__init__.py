"""From a failure to the next attempt's first step.

* :mod:`.restarts`: the restart as the agent runs it (``WORKER_RESTART``, the workers
  started on the warm spares, the next spares started);
* :mod:`.spares`: the warm spares, one waiting worker per local rank;
* :mod:`.anatomy`: how long each phase of a recovery took (``RECOVERED``);
* :mod:`.formation`: the attempt each rendezvous forms, numbered alike on every node;
* :mod:`.membership`: nodes that wait while the rendezvous is full stay spares.
"""
