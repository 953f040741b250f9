"""The job layer.  Its spine, on every job's path: ``job`` (resolve once, the attempts) ->
``restarts`` (again on the policy's word) -> ``attempt`` (plan -> survey -> specs ->
supervise, or a dry run), with ``planning`` and ``survey``.  Beside it, each feature's
orchestration, used when a job asks: ``mpi`` (--mpi), ``syncfiles`` and ``syncing``
(--sync), ``netcheck``, ``stragglers``, ``inspection`` (stacks, top), and sweeps
(``sweepstart``, ``sweeprun``, ``trial``: a module per step that runs apart); the edges'
helpers: ``background``, ``attached``, ``early``, ``discovery``, ``preflight``, ``namedfiles``.
"""
