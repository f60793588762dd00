"""Tiny transformers 5.x mixture-of-experts models, built from a config (no download), and a
3-step training run of one under fp8fn (torch.func or plain autograd) or in float32."""

import torch

import fp8fn

VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _config(arch: str):
    import transformers as tf

    if arch == "mixtral":
        return tf.MixtralConfig(
            **_COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **_COMMON,
            intermediate_size=64,
            moe_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
        )
    if arch == "olmoe":
        return tf.OlmoeConfig(**_COMMON, intermediate_size=48, num_experts=4, num_experts_per_tok=2)
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            **_COMMON,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **_COMMON,
            intermediate_size=64,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
        )
    if arch == "deepseek_v3":
        common = {**_COMMON, "num_key_value_heads": 4}  # (MLA: as many as the heads)
        return tf.DeepseekV3Config(
            **common,
            intermediate_size=64,
            moe_intermediate_size=48,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    if arch == "llama4":
        return tf.Llama4TextConfig(
            **_COMMON,
            intermediate_size=48,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            head_dim=8,
            interleave_moe_layer_step=1,
        )
    raise ValueError(arch)


ARCHS = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3", "llama4")


def build(arch: str, implementation: str = "grouped_mm", seed: int = 0, experts: int = 4):
    """A tiny float32 causal LM of `arch` with `experts` experts per layer run by
    `implementation`."""
    import transformers as tf

    config = _config(arch)
    for field in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hasattr(config, field):
            setattr(config, field, experts)
    torch.manual_seed(seed)
    cls = tf.Llama4ForCausalLM if arch == "llama4" else tf.AutoModelForCausalLM
    model = cls.from_config(config) if cls is tf.AutoModelForCausalLM else cls(config)
    with torch.no_grad():  # weights of a trained scale (HF leaves some 3-D weights empty)
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
    if arch != "llama4":  # (its experts are a bmm of their own, without implementations)
        model.set_experts_implementation(implementation)
    return model


def batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 16), generator=gen)


def train(model, steps=3, fn=None, route="func", lr=0.5):
    """`(losses, first step's grads)` of `steps` SGD steps on one batch: in float32 when `fn`
    is None, else through `fn` (an fp8fn transform of `model`) by `route` ("func": torch.func;
    "autograd": fp8fn.observe and backward). `model` is not changed."""
    ids = batch()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = None if fn is None else fn.init(ids)
    losses, first = [], None
    for _ in range(steps):
        if fn is None:
            leaves = {n: p.requires_grad_() for n, p in params.items()}
            loss = torch.func.functional_call(model, leaves, (ids,), {"labels": ids}).loss
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        elif route == "func":

            def f(p, s):
                return fn.apply(p, s, ids, labels=ids).loss

            (grads, obs), loss = torch.func.grad_and_value(f, argnums=(0, 1))(params, state)
            state = fp8fn.update(state, obs)
        else:
            leaves = {n: p.requires_grad_() for n, p in params.items()}
            observed = fp8fn.observe(state)
            loss = fn.apply(leaves, observed, ids, labels=ids).loss
            loss.backward()
            grads = {n: p.grad for n, p in leaves.items()}
            state = fp8fn.update(state, fp8fn.observations(observed))
        losses.append(loss.item())
        first = first or grads
        params = {n: (p - lr * grads[n]).detach() for n, p in params.items()}
    return losses, first, state
