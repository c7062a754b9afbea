"""The episodic trigger: cut a recorded 17-token dialog stream into per-user sessions (EgoMem §4.1).

`TriggerLabeler(cfg).label(tokens[T, 17]) -> labels[T]` (0 no dialog, 1 start, 2 in session, 3 end)
and `decode_sessions(labels) -> [(start, end)]`. Training: `egomem.trigger.train` (`egomem train-trigger`).
`egomem.trigger.identity_split` then splits a session where the recorded face/voice polls say the person
changed (the memory manager does this, so no session mixes two people).
"""

from egomem.trigger.decode import decode_sessions
from egomem.trigger.labeler import SHIPPED_CHECKPOINT, TriggerLabeler
from egomem.trigger.model import END, IN_SESSION, NO_DIALOG, START

__all__ = ["TriggerLabeler", "decode_sessions", "SHIPPED_CHECKPOINT", "NO_DIALOG", "START", "IN_SESSION", "END"]
