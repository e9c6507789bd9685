"""A placement spec is canonical from construction: its equality and hash never change over its life.

``validate()`` used to write the canonical forms into the user's own frozen object (the attention letters in
QKVC order, ``"2"`` -> 2.0, a list of overrides -> a tuple), so a spec put in a set or used as a dict key before
it was validated (``placements.get``, ``register``, building a model all validate) hashed otherwise after: it was
no longer found in that set, and two specs that build the same block were unequal until both were validated."""

from __future__ import annotations

import dataclasses

import pytest

from hybridnorm import ConfigError, placements
from hybridnorm.placements import BlockSpec, Override, Placement, SublayerSpec

FFN_POST = SublayerSpec(in_norm=True, skip="normed")


def _loose() -> Placement:
    """A spec written with a lossless form in every field that has one."""
    return Placement("loose", BlockSpec(attn={"in_norm": True}, ffn=FFN_POST, qkv_norm="vkq", residual_scale="2",
                                        branch_scale=1),
                     overrides=[Override({"qkv_norm": "kq"}, first_n=1.0)], aliases=["loose_one"])


def test_a_spec_hashed_before_validation_hashes_alike_after_it():
    spec = _loose()
    block = spec.block
    seen, named = {spec, block}, {block: "mine"}
    before = (hash(spec), hash(block))
    placements.get(spec)  # validates
    spec.validate()
    assert (hash(spec), hash(block)) == before
    assert spec in seen and block in seen and named[block] == "mine"


def test_two_spellings_of_one_block_are_equal_from_construction():
    assert BlockSpec(qkv_norm="kq") == BlockSpec(qkv_norm="QK")
    assert hash(BlockSpec(qkv_norm="cKv")) == hash(BlockSpec(qkv_norm="KVC"))
    assert BlockSpec(attn={"in_norm": True}, residual_scale="2") == BlockSpec(attn=SublayerSpec(in_norm=True),
                                                                          residual_scale=2.0)
    exact = Placement("loose", BlockSpec(attn=SublayerSpec(in_norm=True), ffn=FFN_POST, qkv_norm="QKV",
                                         residual_scale=2.0),
                      overrides=(Override(BlockSpec(qkv_norm="QK"), first_n=1),))
    assert _loose() == exact and hash(_loose()) == hash(exact)
    assert _loose().aliases == ("loose_one",)  # no part of equality, but a tuple as the field says
    assert dataclasses.replace(BlockSpec(), qkv_norm="vq").qkv_norm == "QV"  # replace builds anew: canonical too
    assert placements.get("Pre-QKV-Post").block == dataclasses.replace(placements.get("Pre-QK-Pre").block,
                                                                        qkv_norm="vkq", ffn=FFN_POST)


def test_validation_writes_nothing():
    spec = _loose()
    objects = [spec, spec.block, spec.block.attn, spec.block.ffn, *spec.overrides, spec.overrides[0].block]
    fields = [{f.name: getattr(o, f.name) for f in dataclasses.fields(o)} for o in objects]
    assert spec.validate() is spec
    assert [{f.name: getattr(o, f.name) for f in dataclasses.fields(o)} for o in objects] == fields
    for before, o in zip(fields, objects, strict=True):  # the very same values, not equal copies
        assert all(getattr(o, k) is v for k, v in before.items())


@pytest.mark.parametrize(("block", "named"), [
    (BlockSpec(qkv_norm="kqk"), r"block\.qkv_norm='kqk' must be distinct letters"),  # kept as written, refused
    (BlockSpec(residual_scale="two"), r"block\.residual_scale='two' is not one of 'deepnorm'"),
    (BlockSpec(attn={"in_norm": "no"}), r"block\.attn\.in_norm='no' must be true or false"),
])
def test_a_field_with_no_canonical_form_is_kept_and_refused_by_validate_naming_it(block, named):
    with pytest.raises(ConfigError, match=named):
        Placement("x", block).validate()
