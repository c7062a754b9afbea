"""Who is there: face + voice embeddings, adaptive s-norm, the user-key index and `identify`.

docs/architecture.md#identification-every-2-s. Offline defaults are real pretrained models whose weights ship in registry
packages (dlib ResNet faces, Resemblyzer GE2E voices, silero-vad); the paper's models
(Facenet512/RetinaFace via DeepFace, WavLM) load from local paths given in `IdentityConfig`.
Heavy modules import lazily: `from egomem.identity import face` pulls in dlib only when used.
"""

from egomem.identity.errors import InputError, ModelFilesMissing
from egomem.identity.identify import Identification, Identifier
from egomem.identity.index import KeyRecord, UserKeyIndex
from egomem.identity.snorm import AdaptiveSNorm
from egomem.identity.store_backed import StoreBackedIdentifier

__all__ = [
    "AdaptiveSNorm",
    "Identification",
    "Identifier",
    "InputError",
    "KeyRecord",
    "ModelFilesMissing",
    "StoreBackedIdentifier",
    "UserKeyIndex",
]
