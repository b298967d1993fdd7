"""Invariances: scan == unrolled, remat == no remat (logits and gradients), causality by gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxflow.models as models
from tests.hf_reference import padded_batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = models.init_model(models.get_preset("tiny_qwen3"), seed=21)
    path = tmp_path_factory.mktemp("qwen3")
    models.save_pretrained(model, path)
    return path


def _loss_and_grads(model, ids, mask):
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params):
        def loss(params):
            logits = nnx.merge(graphdef, params)(ids, attention_mask=mask)
            logp = jax.nn.log_softmax(logits)
            return -jnp.sum(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0] * mask[:, 1:])

        return jax.value_and_grad(loss)(params)

    return run(params)


def _by_layer(grads, scanned: bool):
    """Flatten a gradient tree into {name: array} with scanned stacks split per layer."""
    out = {}
    for path, v in jax.tree_util.tree_leaves_with_path(grads):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if scanned and keys[:2] == ["model", "layers"]:
            for i in range(v.shape[0]):
                out["/".join(keys[:2] + [str(i)] + keys[2:])] = np.asarray(v[i])
        else:
            out["/".join(keys)] = np.asarray(v)
    return out


def test_scan_equals_unrolled_and_remat_equals_no_remat(checkpoint):
    ids, mask = padded_batch(256, [10, 6, 3], total=10, seed=4)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    ref_loss, ref_grads = _loss_and_grads(models.from_pretrained(checkpoint), ids, mask)
    ref = _by_layer(ref_grads, scanned=False)
    for scan, remat in [(True, "none"), (False, "full"), (True, "dots")]:
        model = models.from_pretrained(checkpoint, scan_layers=scan, remat_policy=remat)
        loss, grads = _loss_and_grads(model, ids, mask)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        got = _by_layer(grads, scanned=scan)
        assert got.keys() == ref.keys()
        for name in ref:
            np.testing.assert_allclose(got[name], ref[name], atol=1e-6, rtol=1e-5, err_msg=f"{name} {scan} {remat}")


def test_causality_gradient_to_later_tokens_is_exactly_zero(checkpoint):
    model = models.from_pretrained(checkpoint)
    graphdef, params = nnx.split(model)
    ids, mask = padded_batch(256, [8, 5], total=8, seed=6)
    embeds = jnp.take(params["model"]["embed_tokens"].get_value(), ids, axis=0)

    def logits_at(embeds, t):
        m = nnx.merge(graphdef, params)
        hidden, _ = m.model(ids, mask, inputs_embeds_BxLxD=embeds)
        return jnp.sum(m.logits(hidden)[:, t] ** 2)

    grad_fn = jax.jit(jax.grad(logits_at))  # t traced: one program for every position
    for t in range(3, 7):
        g = np.asarray(grad_fn(embeds, jnp.int32(t)))
        assert np.all(g[:, t + 1 :] == 0.0), t
        assert np.abs(g[0, : t + 1]).max() > 0  # earlier tokens do matter
