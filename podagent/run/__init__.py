"""The run kernel: what every run does whatever runs its job (Ray, or a launcher without Ray).

Below both engines (cluster/ and gang/), which import it and never each other.
"""
