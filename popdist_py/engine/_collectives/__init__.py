"""One collective, from a replica's call to its result: the call checked and its local meeting
(``dispatch``, ``rendezvous``), the plan of who sends what to whom (``exchange``), the fixed
reduction order (``reduce``, ``segments``: inputs in pieces), and MPI between instances
(``transport``)."""
