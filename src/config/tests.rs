//! Tests of parsing and validating configs.

use super::*;

#[test]
fn default_is_valid() {
    TrainConfig::default().validate().unwrap();
}

#[test]
fn unknown_key_names_the_key() {
    let err = TrainConfig::from_toml("ranks = 2\nstagee = 3\n").unwrap_err();
    assert_eq!(err.field, "stagee");
}

#[test]
fn toml_round_trip_and_partial_files() {
    let cfg = TrainConfig::from_toml("stage = 1\nmodel = \"mlp\"\nreduce = \"fast\"").unwrap();
    assert_eq!(
        (cfg.stage, cfg.model, cfg.reduce),
        (1, ModelKind::Mlp, ReduceMode::Fast)
    );
    assert_eq!(cfg.ranks, TrainConfig::default().ranks);
}

#[test]
fn bad_values_name_the_field() {
    let bad = |f: fn(&mut TrainConfig)| {
        let mut c = TrainConfig::default();
        f(&mut c);
        c.validate().unwrap_err().field
    };
    assert_eq!(bad(|c| c.stage = 4), "stage");
    assert_eq!(bad(|c| c.ranks = 0), "ranks");
    assert_eq!(bad(|c| c.heads = 3), "heads");
    assert_eq!(bad(|c| c.data = Some("/nonexistent/file".into())), "data");
    assert_eq!(bad(|c| c.micro_batches = 0), "micro_batches");
    assert_eq!(bad(|c| c.save_every = 5), "save_every");
    assert_eq!(bad(|c| c.leave = vec!["7@1".parse().unwrap()]), "leave");
    assert_eq!(bad(|c| c.leave = vec!["1@500".parse().unwrap()]), "leave");
    assert_eq!(
        bad(|c| {
            c.max_ranks = 5;
            c.join = vec!["2@3".parse().unwrap()]
        }),
        "join"
    );
    assert_eq!(
        bad(|c| {
            c.min_ranks = 4;
            c.kill = vec!["0@3".parse().unwrap()]
        }),
        "leave"
    );
    assert_eq!(
        bad(|c| c.faults.net_partition_ranks = vec![1]),
        "net_partition_ranks"
    );
    assert_eq!(
        bad(|c| {
            c.faults.net_partition_ranks = vec![64];
            c.faults.net_partition_frames = 10;
            c.faults.net_partition_ms = 2;
        }),
        "net_partition_ranks"
    );
    assert_eq!(
        bad(|c| {
            c.faults.net_partition_ranks = vec![1];
            c.faults.net_partition_frames = 10;
            c.faults.net_partition_ms = 60_000;
        }),
        "net_partition_ms"
    );
}

#[test]
fn a_file_over_a_base_keeps_the_base_where_silent() {
    let base = TrainConfig {
        d_model: 16,
        lr: 1.25e-3,
        save_dir: Some("ck".into()),
        leave: vec![At { value: 1, step: 3 }],
        ..TrainConfig::default()
    };
    let c = TrainConfig::from_toml_over(&base, "ranks = 2\n").unwrap();
    assert_eq!(
        c,
        TrainConfig {
            ranks: 2,
            ..base.clone()
        }
    );
    let err = TrainConfig::from_toml_over(&base, "bogus = 1\n").unwrap_err();
    assert_eq!(err.field, "bogus");
}

#[test]
fn toml_errors_name_the_key_and_its_line() {
    let text = "ranks = 2\n\nprecision = \"fp16\"\n";
    for err in [
        TrainConfig::from_toml(text).unwrap_err(),
        TrainConfig::from_toml_over(&TrainConfig::default(), text).unwrap_err(),
    ] {
        assert_eq!(err.field, "precision");
        assert!(
            err.message.starts_with("line 3: ") && err.message.contains("`fp32` or `bf16`"),
            "{err}"
        );
    }
    let err = TrainConfig::from_toml("stage = 1\nbogus = 1\n").unwrap_err();
    assert_eq!(
        (err.field.as_str(), &err.message[..7]),
        ("bogus", "line 2:")
    );
    let err = TrainConfig::from_toml("ranks = \"two\"\n").unwrap_err();
    assert_eq!(
        (err.field.as_str(), &err.message[..7]),
        ("ranks", "line 1:")
    );
    let c = TrainConfig::from_toml("precision = \"bf16\"\n").unwrap();
    assert_eq!(c.precision, crate::model::backend::Precision::Bf16);
}

#[test]
fn membership_script_parses_from_toml() {
    let c = TrainConfig::from_toml("leave = [\"1@3\"]\njoin = [\"2@5\"]\n").unwrap();
    assert_eq!(c.leave, vec![At { value: 1, step: 3 }]);
    assert_eq!(c.join, vec![At { value: 2, step: 5 }]);
    c.validate().unwrap();
    // A joiner (rank 4) may leave later.
    let c = TrainConfig {
        leave: vec![At { value: 4, step: 7 }],
        ..c
    };
    c.validate().unwrap();
}

#[test]
fn fault_keys_sit_at_the_top_level_and_load_into_the_faults_section() {
    let text = "net_drop_per_mille = 10\nnet_slow_rank = 1\nnet_slow_ms = 3\n\
                kill_during = [\"1@2:reshard\"]\nnvme_fault = \"0:slow@5\"\n";
    let c = TrainConfig::from_toml(text).unwrap();
    assert_eq!(c.faults.net_drop_per_mille, 10);
    assert_eq!((c.faults.net_slow_rank, c.faults.net_slow_ms), (Some(1), 3));
    assert_eq!(c.faults.kill_during.len(), 1);
    assert!(c.faults.nvme_fault.is_some());
    c.validate().unwrap();
    // Over a base (a checkpoint's config), and through JSON (manifests, the worker's welcome):
    // the same flat keys, and no `faults` key.
    let over = TrainConfig::from_toml_over(&c, "ranks = 2\n").unwrap();
    assert_eq!(over.faults, c.faults);
    let json = serde_json::to_value(&c).unwrap();
    assert_eq!(json["net_drop_per_mille"], 10);
    assert!(json.get("faults").is_none(), "{json}");
    let back: TrainConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back, c);
}

#[test]
fn test_hooks_are_no_config_keys() {
    for key in ["panic_at = [1, 2]", "raise_sigterm_at = 2"] {
        let err = TrainConfig::from_toml(key).unwrap_err();
        assert_eq!(err.field, key.split(' ').next().unwrap(), "{err}");
    }
    let mut c = TrainConfig::default();
    c.faults.panic_at = Some((1, 2));
    c.faults.raise_sigterm_at = Some(3);
    let back: TrainConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
    assert_eq!(
        back,
        TrainConfig::default(),
        "a hook never leaves the process"
    );
}
