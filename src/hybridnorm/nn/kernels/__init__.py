"""The fast kernels: hand-written autograd Functions for the model's hot work, all in this package.

Each one computes exactly what a few lines of plain PyTorch in its module compute (its *plain twin*, named
in its docstring), with fewer kernels and fewer temporaries on CPU. ``ModelConfig.fast_kernels`` (default
true) picks them; ``fast_kernels=False`` runs the plain twins, which are the readable definition and what
the tests compare these against (``tests/nn/test_kernels.py`` and ``tests/nn/test_loss_kernels.py``:
gradcheck of every Function in float64, and fast vs plain logits, losses and gradients for every placement).

=======================  ================================================================================
``rms_norm``             ``elementwise.RMSNormFn``; twin ``RMSNorm.forward`` (``hybridnorm.nn.norms``)
``rope``                 ``elementwise.RopeFn``; twin :func:`hybridnorm.nn.rope.apply_rope`
``swiglu``               ``elementwise.SwiGLUFn``; twin the ``silu(gate) * up`` line of ``SwiGLU.forward``
``fused_qkv``            ``attention.QKVPrep``; twin the split / Q-K-V norms / RoPE lines of ``Attention.forward``
``sdpa_in_fp32``         bf16 attention on CPU at head dim < 64 in fp32; twin ``SDPA.forward`` (``nn.attention``)
``cross_entropy``        ``loss.CrossEntropyFn``; twin ``lm_loss(..., fast=False)`` (``hybridnorm.nn.model``)
``linear_cross_entropy`` ``loss.LinearCrossEntropyFn``: LM head + loss without the logits; twin ``lm_loss`` of
                         ``F.linear(hidden, weight)`` (``TransformerLM.forward(..., targets=...)``)
=======================  ================================================================================

One more lives here that is not exact and not picked by ``fast_kernels``: ``float8.Float8LinearFn``, the
blocks' linears on float8 tensor cores (``TrainConfig.float8``, opt-in), tested against its equations on
the dequantized operands in float64 and against bf16 ``F.linear`` within float8's rounding. It runs under
``torch.compile`` too (the speed it is for is the compiled step's).

Without autograd (``torch.no_grad()`` or inputs that need no gradient) each entry point runs the same
forward helper without the Function (nothing is saved for backward).

Under ``torch.compile`` the modules run their plain twins instead (:func:`active`): the compiler fuses the
plain elementwise math itself, and these Functions' ``out=`` writes into strided views would break its graph.
"""

from hybridnorm.nn.kernels.attention import (
    UPCAST_ATTENTION_BELOW_HEAD_DIM,
    QKVPrep,
    fused_qkv,
    fused_qkv_range,
    sdpa_in_fp32,
    upcasts_attention,
)
from hybridnorm.nn.kernels.common import active
from hybridnorm.nn.kernels.elementwise import (
    RMSNormFn,
    RopeFn,
    SwiGLUFn,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rope,
    rope_into,
    swiglu,
)
from hybridnorm.nn.kernels.loss import CrossEntropyFn, LinearCrossEntropyFn, cross_entropy, linear_cross_entropy

__all__ = ["UPCAST_ATTENTION_BELOW_HEAD_DIM", "CrossEntropyFn", "LinearCrossEntropyFn", "QKVPrep", "RMSNormFn",
           "RopeFn", "SwiGLUFn", "active", "cross_entropy", "fused_qkv", "fused_qkv_range", "linear_cross_entropy",
           "rms_norm", "rms_norm_backward", "rms_norm_forward", "rope", "rope_into", "sdpa_in_fp32", "swiglu",
           "upcasts_attention"]
