"""Gradients of a transformers causal LM, shared by tests/integrations/: the input
embeddings' gradient against a reference model's, and training steps with and without
activation checkpointing."""
import copy
import warnings

import torch


def _training_grads(model, batches):
    """The gradients of one SGD step of a causal-LM loss per batch of token ids (train
    mode, parameters updated between steps), by parameter name."""
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    found = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        found.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return found


def assert_same_training_grads(model, batches, trained=("layers.0.self_attn.",)):
    """Training steps with activation checkpointing (transformers'
    ``gradient_checkpointing_enable()``: non-reentrant torch.utils.checkpoint) give the
    gradients of the same steps without, bit for bit (the recomputed forward is the same
    deterministic computation); for each string of ``trained``, a nonzero one among the
    parameters whose names contain it (the first layer's attention: its gradient passes
    back through every experts module).  ``model`` is used as it is, a copy of it
    checkpointed."""
    plain, ckpt = model, copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated name, and use_cache switched off
        ckpt.gradient_checkpointing_enable()
    assert ckpt.is_gradient_checkpointing
    want, got = _training_grads(plain, batches), _training_grads(ckpt, batches)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys() and b
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name, (a[name] - b[name]).abs().max())
        for part in trained:
            assert any(b[n].abs().max() > 0 for n in b if part in n), (step, part)


def assert_same_input_grads(model, reference, ids):
    """The gradient of the squared logits' sum with respect to the input embeddings of
    ``ids`` through ``model`` is ``reference``'s within 1e-5 of its largest element (and
    that is not zero)."""
    grads = []
    for m in (model, reference):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        m(inputs_embeds=emb).logits.square().sum().backward()
        grads.append(emb.grad)
        m.zero_grad(set_to_none=True)
    got, want = grads
    assert want.abs().max() > 0
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
