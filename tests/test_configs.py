"""Experiment configs: every shipped config loads and validates, malformed configs fail with one
clear error naming the key, overrides parse to each key's type, configs load from files."""

import textwrap

import pytest

import jaxflow.configs as configs
from jaxflow.configs import ConfigError, apply_overrides, get_config, load_config, validate
from jaxflow.configs.base import BOUNDS, FIELDS, KEY_DOCS, KEY_TYPES, get_base_config
from jaxflow.configs.docs import main as docs_main
from jaxflow.configs.docs import markdown_table
from jaxflow.configs.overrides import with_values

TINY = [n for n in configs.NAMED if n.endswith("_tiny")]
PAPER = {
    "ppo_7b": ("llama2_7b", 16),
    "ppo_13b": ("llama2_13b", 32),
    "ppo_34b": ("codellama_34b", 64),
    "ppo_70b": ("llama2_70b", 128),
}


# ----------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("name", list(configs.NAMED))
def test_named_config_loads_and_validates(name):
    cfg = get_config(name)
    validate(cfg)
    assert cfg.trainer.experiment_name == name
    assert set(configs.leaf_keys(cfg)) == set(KEY_DOCS)


def test_named_configs_are_the_requested_set():
    assert set(configs.NAMED) == {
        "ppo_tiny",
        "grpo_tiny",
        "grpo_tool_tiny",
        "grpo_code_tiny",
        "dapo_tiny",
        "remax_tiny",
        "rloo_tiny",
        "reinforce_pp_tiny",
        "safe_rlhf_tiny",
        "sft_tiny",
        "ppo_7b",
        "ppo_13b",
        "ppo_34b",
        "ppo_70b",
    }
    assert configs.DEFAULT_CONFIG == "grpo_tiny"
    listing = configs.describe_named()
    assert all(name in listing for name in configs.NAMED)


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_are_cpu_sized(name):
    cfg = get_config(name)
    assert cfg.jaxflow.num_devices == 8 and cfg.jaxflow.placement.type == "auto"
    # the default run (grpo_tiny, and DAPO on it) learns digit reversal, scored on held-out strings;
    # the tool task calls a calculator
    tasks = {
        "grpo_tiny": "reverse_digits",
        "dapo_tiny": "reverse_digits",
        "grpo_tool_tiny": "calculator",
        "grpo_code_tiny": "code",
    }
    assert cfg.jaxflow.data.builtin_task == tasks.get(name, "addition")
    assert not cfg.data.train_files
    model = configs.model_config(cfg, "actor")
    assert 64 <= model.hidden_size <= 128 and 2 <= model.num_layers <= 4
    assert model.vocab_size >= 100  # the char tokenizer's ids (padded to a multiple of fsdp*tp)
    from jaxflow.configs.prepare import prepare_run
    from jaxflow.configs.resolve import pool_size
    from jaxflow.trainer.builders import place_run

    _, _, resolved = place_run(
        prepare_run(cfg, with_datasets=False), cfg, log=None
    )  # the auto-mapper's pools and meshes
    actor = configs.mesh_sizes(resolved, "actor")
    assert actor["dp"] * actor["fsdp"] * actor["tp"] == pool_size(resolved, "actor")
    assert cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n <= 512


def test_tiny_configs_select_their_algorithms():
    est = {n: get_config(n).algorithm.adv_estimator for n in TINY if n != "sft_tiny"}
    assert est == {
        "ppo_tiny": "gae",
        "grpo_tiny": "grpo",
        "grpo_tool_tiny": "grpo",
        "grpo_code_tiny": "grpo",
        "dapo_tiny": "grpo",
        "remax_tiny": "remax",
        "rloo_tiny": "rloo",
        "reinforce_pp_tiny": "reinforce_plus_plus",
        "safe_rlhf_tiny": "grpo",
    }
    assert configs.active_roles(get_config("ppo_tiny")) == ("actor", "ref", "critic")
    grpo = get_config("grpo_tiny")
    assert grpo.actor_rollout_ref.rollout.n >= 4 and "critic" not in configs.active_roles(grpo)
    safe = get_config("safe_rlhf_tiny")
    assert safe.jaxflow.safe_rlhf.enable and safe.jaxflow.safe_rlhf.cost_rule in ("forbidden_chars", "length")
    sft = get_config("sft_tiny")
    assert sft.jaxflow.job == "sft" and configs.active_roles(sft) == ("actor",)
    dapo = get_config("dapo_tiny")  # DAPO: clip-higher, token-mean, dynamic sampling, overlong shaping
    actor = dapo.actor_rollout_ref.actor
    assert actor.clip_ratio_high > actor.clip_ratio_low and actor.loss_agg_mode == "token-mean"
    assert dapo.algorithm.filter_groups.enable and dapo.reward_model.overlong_buffer.enable


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_workloads(name):
    preset, devices = PAPER[name]
    cfg = get_config(name)
    assert cfg.jaxflow.model.preset == preset and cfg.jaxflow.num_devices == devices
    assert cfg.data.max_prompt_length == cfg.data.max_response_length == 1024
    assert cfg.data.train_batch_size == 1024 and cfg.actor_rollout_ref.rollout.n == 1
    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        assert role.ppo_epochs == 1 and cfg.data.train_batch_size // role.ppo_mini_batch_size == 8
    assert (cfg.jaxflow.model.dtype, cfg.jaxflow.optim.state_dtype) == ("bfloat16", "float32")
    assert configs.active_roles(cfg) == ("actor", "ref", "critic", "reward")
    model = configs.model_config(cfg, "critic")
    assert model == configs.model_config(cfg, "reward")  # all four models of one size
    train = configs.mesh_sizes(cfg, "actor")
    assert cfg.jaxflow.mesh.actor.generate.tp < train["fsdp"] * train["tp"]


def test_config_drives_the_real_placement():
    placement = configs.build_placement(
        load_config("ppo_tiny", ["jaxflow.placement.type=colocated"])
    )  # conftest's 8 CPU devices
    assert dict(placement.mesh("actor").shape) == {"dp": 1, "fsdp": 4, "tp": 2}
    assert dict(placement.mesh("actor", "generate").shape) == {"tp": 2, "dp": 4}
    assert placement.colocated_with("actor") == ("actor", "ref", "critic")


def test_split_placement_pools():
    cfg = load_config(
        "ppo_tiny",
        ["jaxflow.placement.type=split", "jaxflow.mesh.actor.train.fsdp=2", "jaxflow.mesh.actor.generate.tp=1"],
    )
    assert configs.placement_groups(cfg) == [
        ("actor", 4, ("actor", "ref")),
        ("critic", 4, ("critic", "reward", "cost")),
    ]
    assert configs.data_parallel_size(cfg, "critic") == 4


# ----------------------------------------------------------------------------- key docs


def test_every_key_documented_and_every_doc_a_key():
    base = set(configs.leaf_keys(get_base_config()))
    assert base == set(KEY_DOCS) == set(KEY_TYPES)
    assert len(FIELDS) == len(KEY_DOCS)  # no key listed twice
    for name in configs.NAMED:
        assert set(configs.leaf_keys(get_config(name))) <= set(KEY_DOCS), name
    for key, doc in KEY_DOCS.items():
        assert doc.strip() and "\n" not in doc, key


def test_docs_markdown(capsys):
    table = markdown_table()
    assert all(f"| `{key}` |" in table for key in KEY_DOCS)
    assert docs_main(["--config=ppo_70b"]) == 0
    out = capsys.readouterr().out
    assert "| `jaxflow.model.preset` | `llama2_70b` |" in out and "| `ppo_tiny` |" in out


# ----------------------------------------------------------------------------- malformed configs

MALFORMED = [
    # (config, overrides, key named, words in the message)
    ("ppo_tiny", ["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator", "did you mean grpo"),
    ("ppo_tiny", ["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    ("ppo_tiny", ["algorithm.kl_penalty=kl3"], "algorithm.kl_penalty", "low_var_kl"),
    ("ppo_tiny", ["data.truncation=middle"], "data.truncation", "error, left, right, filter"),
    ("ppo_tiny", ["trainer.resume_mode=latest"], "trainer.resume_mode", "disable, auto, resume_path"),
    ("ppo_tiny", ["trainer.logger=console,wandbb"], "trainer.logger", "did you mean wandb"),
    ("ppo_tiny", ["jaxflow.placement.type=spread"], "jaxflow.placement.type", "colocated, split, custom"),
    ("ppo_tiny", ["jaxflow.model.dtype=bf16"], "jaxflow.model.dtype", "did you mean bfloat16"),
    ("ppo_tiny", ["jaxflow.model.preset=llama2_8b"], "jaxflow.model.preset", "llama2_7b"),
    (
        "ppo_tiny",
        ["actor_rollout_ref.actor.ppo_mini_batch_size=24"],
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "train_batch_size=32 prompts do not split into mini-batches of 24",
    ),
    (
        "ppo_tiny",
        [
            "jaxflow.placement.type=colocated",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        ],
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "2 responses does not split over the actor's 4 data-parallel ranks",
    ),
    (
        "grpo_tiny",
        ["jaxflow.placement.type=colocated", "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=5"],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_device",
        "16 responses per data-parallel rank",
    ),
    (
        "ppo_tiny",
        ["jaxflow.placement.type=colocated", "critic.ppo_micro_batch_size_per_device=3"],
        "critic.ppo_micro_batch_size_per_device",
        "8 responses per data-parallel rank",
    ),
    (
        "ppo_tiny",
        ["jaxflow.placement.type=colocated", "jaxflow.mesh.critic.fsdp=4"],
        "jaxflow.mesh.critic",
        "4 devices, but the critic's pool has 8",
    ),
    (
        "ppo_tiny",
        ["jaxflow.placement.type=colocated", "jaxflow.mesh.actor.train.tp=3"],
        "jaxflow.mesh.actor.train",
        "do not divide the actor's pool of 8",
    ),
    (
        "ppo_tiny",
        ["jaxflow.placement.type=split", "jaxflow.placement.pool_sizes=(4,2)"],
        "jaxflow.placement.pool_sizes",
        "add up to 6 devices, but jaxflow.num_devices is 8",
    ),
    (
        "ppo_tiny",
        ["jaxflow.placement.type=custom", "jaxflow.placement.groups=actor;critic"],
        "jaxflow.placement.groups",
        "no pool for the active roles ['ref']",
    ),
    (
        "ppo_tiny",
        ["jaxflow.placement.type=colocated", "jaxflow.mesh.actor.generate.tp=3"],
        "jaxflow.mesh.actor.generate.tp",
        "must divide the actor's training weight-parallel degree fsdp*tp = 4*2 = 8",
    ),
    (
        "ppo_tiny",
        [
            "jaxflow.placement.type=colocated",
            "jaxflow.model.num_heads=4",
            "jaxflow.model.num_kv_heads=2",
            "jaxflow.mesh.actor.train.fsdp=1",
            "jaxflow.mesh.actor.train.tp=8",
        ],
        "jaxflow.mesh.actor.train",
        "does not divide num_heads=4",
    ),
    (
        "ppo_70b",
        ["jaxflow.mesh.critic.tp=16", "jaxflow.mesh.critic.fsdp=4"],
        "jaxflow.mesh.critic",
        "tp=16 does not divide num_kv_heads=8",
    ),
    (
        "ppo_tiny",
        ["jaxflow.model.hidden_size=100"],
        "jaxflow.model.num_heads",
        "num_heads=8 does not divide hidden_size=100",
    ),
    ("ppo_tiny", ["critic.enable=false"], "critic.enable", "'gae' needs a critic"),
    ("ppo_tiny", ["actor_rollout_ref.actor.ppo_epochs=0"], "actor_rollout_ref.actor.ppo_epochs", "must be >= 1"),
    ("ppo_tiny", ["actor_rollout_ref.actor.optim.lr=0"], "actor_rollout_ref.actor.optim.lr", "must be > 0"),
    ("ppo_tiny", ["critic.optim.lr=-1e-5"], "critic.optim.lr", "must be > 0"),
    ("ppo_tiny", ["data.max_response_length=0"], "data.max_response_length", "must be >= 1"),
    ("ppo_tiny", ["data.max_response_length=600"], "data.max_response_length", "max_position_embeddings=512"),
    ("grpo_tiny", ["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "needs rollout.n >= 2"),
    ("rloo_tiny", ["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "'rloo'"),
    ("ppo_tiny", ["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "no checkpoint path"),
    ("ppo_tiny", ["custom_reward_function.path=/no/such/reward.py"], "custom_reward_function.path", "file not found"),
    ("ppo_tiny", ["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature", "do_sample"),
    (
        "safe_rlhf_tiny",
        ["jaxflow.safe_rlhf.lambda_update_scale=log", "jaxflow.safe_rlhf.lambda_init=0"],
        "jaxflow.safe_rlhf.lambda_init",
        "log",
    ),
    ("sft_tiny", ["jaxflow.sft.batch_size=30"], "jaxflow.sft.batch_size", "4 data-parallel ranks"),
    (
        "ppo_tiny",
        ["reward_model.enable=true", "reward_model.model.path=preset:llama9"],
        "reward_model.model.path",
        "unknown preset 'llama9'",
    ),
    # DAPO
    ("dapo_tiny", ["algorithm.filter_groups.metric=None"], "algorithm.filter_groups.metric", "must be set"),
    ("dapo_tiny", ["reward_model.overlong_buffer.len=0"], "reward_model.overlong_buffer.len", "must be in [1, "),
    ("dapo_tiny", ["reward_model.overlong_buffer.len=9"], "reward_model.overlong_buffer.len", "max_response_length=8"),
    # verl 0.9.1's estimators and losses
    ("grpo_tiny", ["algorithm.adv_estimator=gdpo"], "algorithm.gdpo_reward_keys", "gdpo needs the reward dimensions"),
    (
        "grpo_tiny",
        ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]", "algorithm.gdpo_reward_weights=[1.0]"],
        "algorithm.gdpo_reward_weights",
        "1 weights for the 2 algorithm.gdpo_reward_keys",
    ),
    ("grpo_tiny", ["algorithm.adv_estimator=optimal_token_baseline"], "algorithm.adv_estimator", "sum_pi_squared"),
    (
        "grpo_tiny",
        ["actor_rollout_ref.actor.policy_loss.loss_mode=dro"],
        "actor_rollout_ref.actor.policy_loss.dro_beta",
        "needs a positive dro_beta",
    ),
    (
        "grpo_tiny",
        ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=0"],
        "actor_rollout_ref.actor.tau_neg",
        "must be > 0",
    ),
    (
        "grpo_tiny",
        ["algorithm.rollout_correction.rollout_is=token"],
        "algorithm.rollout_correction.rollout_is",
        "decoupled mode",
    ),
    (
        "grpo_tiny",
        ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=tokens"],
        "algorithm.rollout_correction.rollout_is",
        "token, sequence",
    ),
    (
        "grpo_tiny",
        [
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        ],
        "algorithm.rollout_correction.rollout_rs",
        "invalid rollout_rs option 'seq_max_k1'",
    ),
    (
        "grpo_tiny",
        ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_rs=token_k2"],
        "algorithm.rollout_correction.rollout_rs_threshold",
        "must be provided",
    ),
    (
        "grpo_tiny",
        ["algorithm.rollout_correction.loss_type=ppo"],
        "algorithm.rollout_correction.loss_type",
        "ppo_clip, reinforce",
    ),
]


@pytest.mark.parametrize("name,overrides,key,words", MALFORMED, ids=[m[2] + ":" + m[1][-1] for m in MALFORMED])
def test_malformed_config_gives_one_clear_error(name, overrides, key, words):
    cfg = apply_overrides(get_config(name), overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    err = info.value
    assert err.problems == [(key, err.problems[0][1])], str(err)  # exactly one problem, this key
    assert str(err).startswith(key + ":") and words in str(err), str(err)
    assert isinstance(err, ValueError)


def _outside(key):
    """Values of ``key`` just outside its bound, below and (if it has one) above, in its type."""
    bound, (typ, _) = BOUNDS[key], KEY_TYPES[key]
    step = 1 if typ is int else 0.5
    values = [bound.lo - (step if bound.ends[0] == "[" else 0)]
    if bound.hi != float("inf"):
        values.append(bound.hi + (step if bound.ends[1] == "]" else 0))
    values = [v - step if v in bound.also else v for v in values]
    return [(v, 0.999) if typ in (tuple, list) else int(v) if typ is int else v for v in values]


@pytest.mark.parametrize("key", sorted(BOUNDS))
def test_a_value_outside_its_bound_is_refused_naming_the_bound(key):
    """The FIELDS table's bounds, checked alike for every key (ppo_tiny runs a critic; the KL
    controller made adaptive): a value just outside is refused, naming the key and the bound."""
    for bad in _outside(key):
        cfg = with_values(get_config("ppo_tiny"), {"algorithm.kl_ctrl.type": "adaptive", key: bad})
        with pytest.raises(ConfigError) as info:
            validate(cfg)
        assert f"{key}: must be {BOUNDS[key].describe()}, got" in str(info.value), (bad, str(info.value))


def test_several_problems_reported_together():
    cfg = apply_overrides(get_config("ppo_tiny"), ["data.truncation=middle", "actor_rollout_ref.actor.ppo_epochs=0"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert {k for k, _ in info.value.problems} == {"data.truncation", "actor_rollout_ref.actor.ppo_epochs"}
    assert str(info.value).startswith("2 problems in the config:")


def test_model_shape_from_a_checkpoint_config_json(tmp_path):
    """An RL config starting from a checkpoint (e.g. sft_tiny's output) reads its shape from
    config.json, and the meshes are checked against it."""
    import json

    tiny = configs.model_config(get_config("sft_tiny"), "actor")
    (tmp_path / "config.json").write_text(json.dumps(tiny.to_hf_dict()))
    cfg = load_config(
        "grpo_tiny",
        [
            f"actor_rollout_ref.model.path={tmp_path}",
            "jaxflow.model.preset=llama2_7b",
            "jaxflow.placement.type=colocated",
        ],
    )
    model = configs.model_config(cfg, "actor")
    assert (model.vocab_size, model.hidden_size, model.num_heads) == (tiny.vocab_size, tiny.hidden_size, tiny.num_heads)
    (tmp_path / "config.json").write_text(
        json.dumps(tiny.replace(num_heads=3, num_kv_heads=1, head_dim=32).to_hf_dict())
    )
    with pytest.raises(ConfigError) as info:  # 3 heads split neither fsdp*tp=8 nor tp=2 ways
        validate(cfg)
    assert info.value.key == "jaxflow.mesh.actor.train" and "num_heads=3" in str(info.value)
    assert configs.model_config(apply_overrides(cfg, [f"actor_rollout_ref.model.path={tmp_path}/nothing"])) is None


def test_custom_reward_file_that_exists_validates(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    load_config("ppo_tiny", [f"custom_reward_function.path={path}"])


# ----------------------------------------------------------------------------- overrides


def test_overrides_parse_each_type():
    cfg = get_config("ppo_tiny")
    apply_overrides(
        cfg,
        [
            "data.shuffle=false",
            "actor_rollout_ref.actor.use_kl_loss=1",
            "critic.shuffle=True",
            "data.train_batch_size=128",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "algorithm.gamma=1",
            "trainer.experiment_name=my run",
            "data.prompt_key='question'",
            "jaxflow.placement.pool_sizes=(4, 4)",
            "actor_rollout_ref.actor.optim.betas=0.9,0.95",
            "trainer.logger=console,jsonl",
            "--config.trainer.total_training_steps=7",
            "config.critic.enable=None",
            "trainer.max_actor_ckpt_to_keep=null",
            "custom_reward_function.path=~/r.py",
        ],
    )
    assert cfg.data.shuffle is False and cfg.actor_rollout_ref.actor.use_kl_loss is True and cfg.critic.shuffle is True
    assert cfg.data.train_batch_size == 128 and isinstance(cfg.data.train_batch_size, int)
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6 and isinstance(cfg.algorithm.gamma, float)
    assert cfg.trainer.experiment_name == "my run" and cfg.data.prompt_key == "question"
    assert cfg.jaxflow.placement.pool_sizes == (4, 4) and cfg.actor_rollout_ref.actor.optim.betas == (0.9, 0.95)
    assert cfg.trainer.logger == ["console", "jsonl"] and cfg.trainer.total_training_steps == 7
    assert cfg.critic.enable is None and cfg.trainer.max_actor_ckpt_to_keep is None
    assert cfg.custom_reward_function.path == "~/r.py"
    apply_overrides(cfg, ["trainer.logger=['wandb']", "trainer.total_training_steps=None", "critic.enable=true"])
    assert cfg.trainer.logger == ["wandb"] and cfg.trainer.total_training_steps is None and cfg.critic.enable is True


@pytest.mark.parametrize(
    "override,words",
    [
        ("trainer.total_epochs=1.5", ["trainer.total_epochs", "expected int", "'1.5'"]),
        ("data.shuffle=maybe", ["data.shuffle", "expected bool", "'maybe'"]),
        ("actor_rollout_ref.actor.optim.lr=fast", ["actor_rollout_ref.actor.optim.lr", "expected float", "'fast'"]),
        ("data.max_prompt_length=None", ["data.max_prompt_length", "expected int", "'None'"]),
        ("critic.enable=sometimes", ["critic.enable", "expected bool (true/false/1/0) or None", "'sometimes'"]),
        ("jaxflow.placement.pool_sizes=(4,'x')", ["jaxflow.placement.pool_sizes", "expected tuple", "(4,'x')"]),
        ("actor_rollout_ref.actor.optim.betas=(0.9,'a')", ["actor_rollout_ref.actor.optim.betas", "expected tuple"]),
    ],
)
def test_override_wrong_type(override, words):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_config("ppo_tiny"), [override])
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize(
    "override,key,close",
    [
        ("actor_rollout_ref.actor.lrr=1", "actor_rollout_ref.actor.lrr", "actor_rollout_ref.actor.optim.lr"),
        ("actor.optim.lr=1", "actor.optim.lr", "actor_rollout_ref.actor.optim.lr"),
        ("data.train_batchsize=8", "data.train_batchsize", "data.train_batch_size"),
        ("algorithm.kl_ctrl.kl_coeff=0.1", "algorithm.kl_ctrl.kl_coeff", "algorithm.kl_ctrl.kl_coef"),
    ],
)
def test_override_unknown_key_suggests(override, key, close):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_config("ppo_tiny"), [override])
    assert info.value.key == key and "unknown config key" in str(info.value) and close in str(info.value)


def test_override_group_and_malformed():
    with pytest.raises(ConfigError, match="group of keys.*jaxflow.mesh.actor.train.tp"):
        apply_overrides(get_config("ppo_tiny"), ["jaxflow.mesh.actor=3"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        apply_overrides(get_config("ppo_tiny"), ["data.shuffle"])


def test_get_config_is_locked():
    cfg = get_config("ppo_tiny")
    with pytest.raises(AttributeError):
        cfg.data.new_key = 1


def test_parse_cli_args():
    name, overrides, rest = configs.parse_cli_args(
        ["--config=grpo_tiny", "--config.actor_rollout_ref.rollout.n=4", "--config.data.seed", "3", "--verbose"]
    )
    assert name == "grpo_tiny" and rest == ["--verbose"]
    assert overrides == ["actor_rollout_ref.rollout.n=4", "data.seed=3"]
    assert configs.parse_cli_args(["--config", "x.py"])[0] == "x.py"
    assert configs.parse_cli_args([])[0] == configs.DEFAULT_CONFIG == "grpo_tiny"


# ----------------------------------------------------------------------------- config files


def test_config_from_file(tmp_path):
    path = tmp_path / "my_rloo.py"
    path.write_text(
        textwrap.dedent("""
        from jaxflow.configs.base import get_base_config

        def get_config():
            cfg = get_base_config()
            cfg.trainer.experiment_name = "my_rloo"
            cfg.algorithm.adv_estimator = "rloo"
            cfg.actor_rollout_ref.rollout.n = 4
            return cfg
    """)
    )
    cfg = load_config(str(path), ["actor_rollout_ref.rollout.n=2"])
    assert cfg.trainer.experiment_name == "my_rloo" and cfg.actor_rollout_ref.rollout.n == 2
    assert configs.active_roles(cfg) == ("actor",)


def test_config_file_with_unknown_key(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text(
        textwrap.dedent("""
        from jaxflow.configs.base import get_base_config

        def get_config():
            cfg = get_base_config()
            cfg.actor_rollout_ref.actor.lrr = 1e-6
            return cfg
    """)
    )
    with pytest.raises(ConfigError) as info:
        validate(get_config(str(path)))
    assert info.value.key == "actor_rollout_ref.actor.lrr" and "actor_rollout_ref.actor.optim.lr" in str(info.value)


def test_config_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: 'nowhere/cfg.py'"):
        get_config("nowhere/cfg.py")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="defines no get_config"):
        get_config(str(tmp_path / "empty.py"))
    with pytest.raises(ConfigError) as info:
        get_config("ppo_tnyi")
    assert "did you mean ppo_tiny" in str(info.value) and all(n in str(info.value) for n in configs.NAMED)


def test_missing_key_in_config():
    cfg = get_base_config()
    del cfg.trainer["seed"]
    with pytest.raises(ConfigError, match="trainer.seed: missing"):
        validate(cfg)


def test_docs_config_md_is_current():
    """docs/CONFIG.md is what `python -m jaxflow.configs.docs` prints (regenerate it when keys change)."""
    import contextlib
    import io
    import pathlib

    from jaxflow.configs import docs

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        docs.main([])
    path = pathlib.Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
    assert path.read_text() == out.getvalue(), "run: python -m jaxflow.configs.docs > docs/CONFIG.md"
