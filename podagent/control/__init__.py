"""The asking commands: `podagent status`, `stop` and `logs`, from any pod.

Everything is read from the head: the node table from its GCS, the run's job from its Jobs API
(the job whose metadata names a podagent run), the reward server's /health. They find the head
as a worker would (discovery), but give up within seconds: a person is waiting.
"""
