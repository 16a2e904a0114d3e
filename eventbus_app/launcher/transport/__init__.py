"""Events into the agent's bus: the workers' events over the job's c10d store
(:mod:`.store`) and torch's own records of the agent (:mod:`.torch_records`)."""
