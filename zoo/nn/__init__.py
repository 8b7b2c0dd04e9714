"""Layers of the zoo: unbatched Equinox modules (batch with `jax.vmap`)."""

from ._attend import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from ._attend import attend as attend
from ._attention import Attention as Attention
from ._axes import AxisNamed as AxisNamed
from ._axes import logical_axes as logical_axes
from ._block import Block as Block
from ._linear import Embedding as Embedding
from ._linear import Linear as Linear
from ._mlp import GeluMLP as GeluMLP
from ._mlp import SwiGLU as SwiGLU
from ._norm import LayerNorm as LayerNorm
from ._norm import RMSNorm as RMSNorm
from ._remat import Remat as Remat
from ._rotary import Llama3RopeScaling as Llama3RopeScaling
from ._rotary import RotaryEmbedding as RotaryEmbedding
from ._rotary import rope_inv_freq as rope_inv_freq
from ._stack import Stack as Stack
from ._stack import checkpoint_names as checkpoint_names
from ._stack import with_prefetch as with_prefetch
from ._stack import with_remat as with_remat
from ._stack import with_scan as with_scan
