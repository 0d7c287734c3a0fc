"""The engine pool: model id -> running engine (`EnginePool`), split by job.

``engine_pool`` is the front that composes the parts; ``catalogue`` knows the servable ids,
aliases and profiles; ``loaded`` the loaded models, their leases and TTLs; ``memory_policy``
makes room for loads and acts for the memory enforcer; ``status`` shapes the status rows;
``model`` holds the record of one model. Imports run in that order, one way (the architecture
test checks it); nothing inside the package imports this face.
"""

from omlx.engine.factory import EncoderEntry, PoolEntry
from omlx.pool.engine_pool import EnginePool
from omlx.pool.loaded import ModelLease, chat_entry, encoder_entry
from omlx.pool.model import ModelState, PoolEvent

__all__ = ["EncoderEntry", "EnginePool", "ModelLease", "ModelState", "PoolEntry", "PoolEvent", "chat_entry",
           "encoder_entry"]
