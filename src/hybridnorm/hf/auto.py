"""Our classes in transformers' ``Auto`` factories and in its tables of class names (done on
``import hybridnorm.hf``; a folder loaded with ``trust_remote_code=True`` reaches the same classes through its
``auto_map``, hybridnorm.hf.remote_code)."""

from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.models.auto import modeling_auto

from hybridnorm.hf.configuration import MODEL_TYPE, HybridNormConfig
from hybridnorm.hf.heads import (
    HybridNormForQuestionAnswering,
    HybridNormForSequenceClassification,
    HybridNormForTokenClassification,
)
from hybridnorm.hf.modeling import HybridNormForCausalLM, HybridNormModel

__all__ = ["CLASSES", "register"]

# each Auto factory, the class it gives for our config, and transformers' table of class names for it
CLASSES = (
    (AutoModel, HybridNormModel, "MODEL_MAPPING_NAMES"),
    (AutoModelForCausalLM, HybridNormForCausalLM, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    (AutoModelForSequenceClassification, HybridNormForSequenceClassification,
     "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    (AutoModelForTokenClassification, HybridNormForTokenClassification, "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    (AutoModelForQuestionAnswering, HybridNormForQuestionAnswering, "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
)


def register() -> None:
    """Register the classes with the Auto factories (idempotent), and name them in transformers' class-name
    tables.

    ``register`` alone is not enough: parts of transformers recognise a model's task by those tables, which it
    does not touch. ``Trainer`` with ``label_smoothing_factor`` shifts the labels only for a class named in
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: any other model is scored against its own input tokens, silently;
    ``pipeline()`` checks a model against its task's table. The Auto factories never see these entries: every
    lookup there goes through ``CONFIG_MAPPING_NAMES``, where ``hybridnorm`` is not (our config is reached
    through the registered classes)."""
    try:
        AutoConfig.register(MODEL_TYPE, HybridNormConfig)
    except ValueError:  # already registered
        pass
    for factory, cls, table in CLASSES:
        try:
            factory.register(HybridNormConfig, cls)
        except ValueError:  # already registered
            pass
        getattr(modeling_auto, table).setdefault(MODEL_TYPE, cls.__name__)
