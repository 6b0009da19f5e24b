//! The tier planner's tests: placements, staging sizes and refusals.

use super::*;

fn demand(stage: Stage, total: u64, ranks: u64) -> Demand {
    Demand {
        stage,
        ranks_in_process: ranks,
        total_elems: total,
        owned_elems: total / ranks,
        largest_unit_elems: total / 10,
        units: 10,
        tied_elems: 0,
        grad_elem_bytes: 8,
        state_per_param: 2,
        param_copy_bytes: 4,
        max_live_units: 2,
        compute_bytes: uniform_compute(stage, total / 10, 4),
        activation_bytes: 1 << 20,
        backups: false,
        snapshots: Snapshots::None,
        chunk_elems: 8192,
        clipping: true,
    }
}

/// The working set of ten equal untied units of `unit` elements, two gathered at a time.
fn uniform_compute(stage: Stage, unit: u64, param_copy_bytes: u64) -> u64 {
    let shape = working::StepShape {
        stage,
        grad_elem_bytes: 8,
        param_copy_bytes,
        max_live_units: 2,
    };
    working::compute_bytes(&working::uniform(10, unit), &[], shape)
}

fn limits(opt: Offload, params: Offload, budget: u64) -> Limits {
    Limits {
        optimizer: opt,
        params,
        grads: Offload::Auto,
        has_nvme_dir: true,
        budget: Budget::Configured(budget),
        tile_elems: None,
    }
}

#[test]
fn ample_memory_keeps_everything_in_ram() {
    let d = demand(Stage::Zero3, 1_000_000, 1);
    let fit = place(&d, &limits(Offload::Auto, Offload::Auto, 1 << 34)).unwrap();
    assert_eq!(fit.placement, Placement::RAM);
    assert_eq!(fit.staging_buffers, 0);
    assert_eq!(fit.per_rank.tier, 0);
    // 4 (p) + 8 (m, v) + 4 (the reduced gradient's f32 mean, whatever the accumulator's
    // width) bytes per parameter, plus the working set.
    assert_eq!(fit.per_rank.params + fit.per_rank.optimizer, 12_000_000);
    assert_eq!(fit.per_rank.grads, 4_000_000);
}

#[test]
fn auto_offloads_the_optimizer_first_then_the_parameters() {
    let d = demand(Stage::Zero3, 100_000_000, 1);
    let all = evaluate(&d, Placement::RAM, DEFAULT_TILE_ELEMS).process_bytes;
    let opt = Placement {
        optimizer: Tier::Nvme,
        ..Placement::RAM
    };
    let opt_need = evaluate(&d, opt, DEFAULT_TILE_ELEMS).process_bytes;
    assert!(opt_need < all);
    let fit = place(&d, &limits(Offload::Auto, Offload::Auto, opt_need)).unwrap();
    assert_eq!(fit.placement, opt);
    assert_eq!(fit.per_rank.tier, 800_000_000);
    // Smaller records come before more offload.
    let least = evaluate(&d, opt, MIN_TILE_ELEMS).process_bytes;
    let fit = place(&d, &limits(Offload::Auto, Offload::Auto, least)).unwrap();
    assert_eq!((fit.placement, fit.tile_elems), (opt, MIN_TILE_ELEMS));
    let fit = place(&d, &limits(Offload::Auto, Offload::Auto, least - 1)).unwrap();
    assert_eq!(fit.placement.params, Tier::Nvme);
    assert_eq!(fit.per_rank.tier, 1_200_000_000);
    assert_eq!(fit.per_rank.params, 0);
}

#[test]
fn staging_records_shrink_to_fit_and_stay_aligned() {
    let d = demand(Stage::Zero3, 1_000_000, 1);
    let both = Placement {
        optimizer: Tier::Nvme,
        params: Tier::Nvme,
        grads: Tier::Nvme,
    };
    let big = evaluate(&d, both, DEFAULT_TILE_ELEMS).process_bytes;
    let fit = place(&d, &limits(Offload::Nvme, Offload::Nvme, big - 1)).unwrap();
    assert!(fit.tile_elems < DEFAULT_TILE_ELEMS);
    assert!(fit.tile_elems >= MIN_TILE_ELEMS);
    assert_eq!(fit.per_rank.staging % IO_ALIGN_BYTES, 0);
    assert_eq!(
        fit.per_rank.staging,
        STAGING_BUFFERS * fit.tile_elems * 4 * 3
    );
}

#[test]
fn staging_grows_for_the_optimizers_reads_ahead_where_the_budget_has_room() {
    // 1M parameters in 10 units over 2 ranks: 500,000 owned, records of 131,072 elements (the
    // largest unit, 100,000, rounded up to a power of two), so at most 4 + 10 records a rank.
    let d = demand(Stage::Zero3, 1_000_000, 2);
    let opt = Placement {
        optimizer: Tier::Nvme,
        ..Placement::RAM
    };
    let base = evaluate(&d, opt, 131_072);
    let record = base.per_rank.staging / STAGING_BUFFERS;
    assert_eq!(record, 131_072 * 4 * 2);
    let ample = limits(Offload::Nvme, Offload::None, 1 << 34);
    let fit = place(&d, &ample).unwrap();
    assert_eq!((fit.placement, fit.tile_elems), (opt, 131_072));
    assert_eq!(fit.staging_buffers, 14 + STAGING_BUFFERS);
    assert_eq!(fit.per_rank.staging, fit.staging_buffers * record);
    assert_eq!(fit.process_bytes, base.process_bytes + 2 * 14 * record);
    // They take at most a quarter of what the budget leaves: room for 3 more a rank here.
    let tight = limits(
        Offload::Nvme,
        Offload::None,
        base.process_bytes + 4 * 2 * 3 * record,
    );
    let fit = place(&d, &tight).unwrap();
    assert_eq!(fit.staging_buffers, STAGING_BUFFERS + 3);
    assert!(fit.process_bytes <= base.process_bytes + 4 * 2 * 3 * record);
    // And none where the budget is the plan's own.
    let exact = limits(Offload::Nvme, Offload::None, base.process_bytes);
    assert_eq!(place(&d, &exact).unwrap().staging_buffers, STAGING_BUFFERS);
    // The gradients on the tier as well: their records are read ahead too, with the gradient.
    let grads = Limits {
        grads: Offload::Nvme,
        ..ample
    };
    let fit = place(&d, &grads).unwrap();
    assert_eq!(fit.placement.grads, Tier::Nvme);
    assert_eq!(fit.staging_buffers, 14 + STAGING_BUFFERS);
    assert_eq!(fit.per_rank.staging, fit.staging_buffers * 131_072 * 4 * 3);
    // The parameters on the tier: their reads are the passes' own, nothing grows.
    let params = limits(Offload::Nvme, Offload::Nvme, 1 << 34);
    let fit = place(&d, &params).unwrap();
    assert_eq!(fit.placement.params, Tier::Nvme);
    assert_eq!(fit.staging_buffers, STAGING_BUFFERS);
    // A model of many small units stops at the cap.
    let many = Demand { units: 1000, ..d };
    assert_eq!(
        place(&many, &ample).unwrap().staging_buffers,
        MAX_STAGING_BUFFERS
    );
}

#[test]
fn the_working_set_counts_what_the_step_holds_at_once() {
    // One rank, everything on the tier, units of 10M elements, two gathered at a time. The
    // backward holds two exact accumulators (the lagged reduce-scatter), a micro-batch
    // gradient, and beside them the parameter shard read for a gather, the next one read
    // ahead and the f32 mean gradient being written: 4·2 + 8·2 + 4 + 4·2 + 4 bytes an
    // element of the unit.
    let d = demand(Stage::Zero3, 100_000_000, 1);
    let all = Placement {
        optimizer: Tier::Nvme,
        params: Tier::Nvme,
        grads: Tier::Nvme,
    };
    let unit = 10_000_000;
    let fit = evaluate(&d, all, DEFAULT_TILE_ELEMS);
    assert_eq!(fit.per_rank.working, (8 + 16 + 4 + 8 + 4) * unit);
    // Stage 1 accumulates into its resident gradients and keeps no gathered units.
    let d1 = demand(Stage::Zero1, 100_000_000, 1);
    let ram = Placement {
        optimizer: Tier::Ram,
        params: Tier::Ram,
        grads: Tier::Ram,
    };
    let fit1 = evaluate(&d1, ram, DEFAULT_TILE_ELEMS);
    assert_eq!(fit1.per_rank.working, (8 + 4) * unit);
}

#[test]
fn updates_run_in_the_backward_only_with_everything_on_the_tier_and_clipping_off() {
    let all = Placement {
        optimizer: Tier::Nvme,
        params: Tier::Nvme,
        grads: Tier::Nvme,
    };
    let clipped = demand(Stage::Zero3, 100_000_000, 1);
    let off = Demand {
        clipping: false,
        ..clipped
    };
    let after = evaluate(&clipped, all, DEFAULT_TILE_ELEMS);
    let during = evaluate(&off, all, DEFAULT_TILE_ELEMS);
    assert!(!after.update_in_backward && during.update_in_backward);
    // p, m and v twice (the step's update goes to the second copy), no gradients: 24 bytes a
    // parameter instead of 16; records of three values instead of four; RAM as before.
    assert_eq!(after.per_rank.tier, 16 * 100_000_000);
    assert_eq!(during.per_rank.tier, 24 * 100_000_000);
    assert_eq!(
        during.per_rank.staging,
        STAGING_BUFFERS * DEFAULT_TILE_ELEMS * 4 * 3
    );
    assert_eq!(during.per_rank.working, after.per_rank.working);
    // Anything in RAM, or another stage, keeps the update after the backward.
    for p in [
        Placement {
            grads: Tier::Ram,
            ..all
        },
        Placement {
            optimizer: Tier::Ram,
            ..all
        },
    ] {
        assert!(!evaluate(&off, p, DEFAULT_TILE_ELEMS).update_in_backward);
    }
    let stage2 = Demand {
        stage: Stage::Zero2,
        ..off
    };
    assert!(!updates_in_backward(stage2.stage, all, false));
}

#[test]
fn the_update_in_the_backward_reuses_the_gathered_parameters_where_they_fit() {
    let all = Placement {
        optimizer: Tier::Nvme,
        params: Tier::Nvme,
        grads: Tier::Nvme,
    };
    let off = Demand {
        clipping: false,
        ..demand(Stage::Zero3, 100_000_000, 1)
    };
    let without = evaluate(&off, all, DEFAULT_TILE_ELEMS);
    let with = evaluate_with(&off, all, DEFAULT_TILE_ELEMS, true);
    assert!(with.update_reuses_params && !without.update_reuses_params);
    // Two shards kept, one running update's and the next's.
    let shard = off.largest_unit_elems * off.owned_elems / off.total_elems;
    assert_eq!(with.per_rank.working, without.per_rank.working + 8 * shard);
    let only = |allow: Offload| Limits {
        grads: allow,
        ..limits(Offload::Nvme, Offload::Nvme, with.process_bytes)
    };
    // Room for the kept shards: reused; a byte less at the same record size: read again.
    assert!(
        place(&off, &only(Offload::Nvme))
            .unwrap()
            .update_reuses_params
    );
    let tight = Limits {
        budget: Budget::Configured(with.process_bytes - 1),
        tile_elems: Some(DEFAULT_TILE_ELEMS),
        ..only(Offload::Nvme)
    };
    let fit = place(&off, &tight).unwrap();
    assert!(fit.update_in_backward && !fit.update_reuses_params);
    // Not with clipping on (no update in the backward), nor under bf16, whose gathered unit
    // holds rounded values, not the masters.
    let clipped = demand(Stage::Zero3, 100_000_000, 1);
    assert!(!evaluate_with(&clipped, all, DEFAULT_TILE_ELEMS, true).update_reuses_params);
    let bf16 = Demand {
        param_copy_bytes: 2,
        ..off
    };
    assert!(!evaluate_with(&bf16, all, DEFAULT_TILE_ELEMS, true).update_reuses_params);
}

#[test]
fn memory_stays_bounded_as_the_model_grows() {
    // With everything offloaded, RAM grows only with the largest unit, not with the
    // parameter, optimizer or gradient state.
    let both = Placement {
        optimizer: Tier::Nvme,
        params: Tier::Nvme,
        grads: Tier::Nvme,
    };
    let small = evaluate(&demand(Stage::Zero3, 1 << 24, 1), both, DEFAULT_TILE_ELEMS);
    let large = evaluate(&demand(Stage::Zero3, 1 << 28, 1), both, DEFAULT_TILE_ELEMS);
    assert_eq!(small.per_rank.staging, large.per_rank.staging);
    assert_eq!(
        large.per_rank.optimizer + large.per_rank.params + large.per_rank.grads,
        0
    );
    // p 4 + m, v 8 + the f32 mean gradient 4 bytes per parameter.
    assert_eq!(large.per_rank.tier, 16 << 28);
}

#[test]
fn an_explicit_choice_is_kept_or_refused_never_changed() {
    let d = demand(Stage::Zero3, 100_000_000, 1);
    let err = place(&d, &limits(Offload::None, Offload::None, 1 << 30)).unwrap_err();
    let FitError::DoesNotFit(msg) = err else {
        panic!("{err:?}")
    };
    assert!(msg.contains("may use 1.00 GiB (memory_max_bytes)"), "{msg}");
    assert!(
        msg.contains(
            "--offload-optimizer nvme --offload-params nvme --offload-grads nvme would fit it"
        ),
        "{msg}"
    );
    let fit = place(&d, &limits(Offload::Nvme, Offload::None, 1 << 34)).unwrap();
    assert_eq!(fit.placement.optimizer, Tier::Nvme);
    assert_eq!(fit.placement.params, Tier::Ram);
}

#[test]
fn below_every_plan_the_refusal_names_the_smallest_budget() {
    let d = demand(Stage::Zero3, 100_000_000, 1);
    let err = place(&d, &limits(Offload::Auto, Offload::Auto, 1 << 20)).unwrap_err();
    let FitError::DoesNotFit(msg) = err else {
        panic!("{err:?}")
    };
    let both = Placement {
        optimizer: Tier::Nvme,
        params: Tier::Nvme,
        grads: Tier::Nvme,
    };
    let least = evaluate(&d, both, MIN_TILE_ELEMS).process_bytes;
    assert!(
        msg.contains(&format!("raise --memory-max to at least {}", gib(least))),
        "{msg}"
    );
}

#[test]
fn without_a_directory_auto_stays_in_ram_and_says_what_to_set() {
    let d = demand(Stage::Zero2, 100_000_000, 1);
    let lim = Limits {
        has_nvme_dir: false,
        ..limits(Offload::Auto, Offload::Auto, 1 << 30)
    };
    let FitError::DoesNotFit(msg) = place(&d, &lim).unwrap_err() else {
        panic!()
    };
    assert!(
        msg.contains("--offload-optimizer nvme --offload-grads nvme --nvme-dir DIR would fit it"),
        "{msg}"
    );
}

#[test]
fn bad_combinations_are_refused() {
    let d = demand(Stage::Zero2, 1000, 1);
    let big = 1 << 34;
    assert_eq!(
        place(&d, &limits(Offload::Auto, Offload::Nvme, big)),
        Err(FitError::ParamsNeedStage3)
    );
    assert_eq!(
        place(&d, &limits(Offload::Cpu, Offload::Auto, big)),
        Err(FitError::CpuReserved {
            key: "offload_optimizer"
        })
    );
    let lim = Limits {
        has_nvme_dir: false,
        ..limits(Offload::Nvme, Offload::Auto, big)
    };
    assert_eq!(place(&d, &lim), Err(FitError::NoNvmeDir));
}

#[test]
fn every_explicit_combination_the_stage_allows_is_placed() {
    let d = demand(Stage::Zero3, 1_000_000, 2);
    for opt in [Offload::None, Offload::Nvme] {
        for params in [Offload::None, Offload::Nvme] {
            for grads in [Offload::None, Offload::Nvme] {
                let lim = Limits {
                    params,
                    grads,
                    ..limits(opt, Offload::Auto, 1 << 34)
                };
                let fit = place(&d, &lim).unwrap();
                let tier = |o| {
                    if o == Offload::Nvme {
                        Tier::Nvme
                    } else {
                        Tier::Ram
                    }
                };
                assert_eq!(
                    (
                        fit.placement.optimizer,
                        fit.placement.params,
                        fit.placement.grads
                    ),
                    (tier(opt), tier(params), tier(grads))
                );
            }
        }
    }
    let d2 = demand(Stage::Zero2, 1_000_000, 2);
    let lim = Limits {
        grads: Offload::Nvme,
        ..limits(Offload::None, Offload::Auto, 1 << 34)
    };
    assert_eq!(place(&d2, &lim).unwrap().placement.grads, Tier::Nvme);
}

#[test]
fn in_process_ranks_add_up() {
    let one = evaluate(&demand(Stage::Zero3, 1 << 20, 4), Placement::RAM, 1 << 18);
    assert_eq!(one.process_bytes, BASE_BYTES + 4 * one.per_rank.ram());
}

#[test]
fn backups_are_copies_in_ram_or_files_beside_the_tier() {
    let plain = demand(Stage::Zero3, 1 << 24, 2);
    let d = Demand {
        backups: true,
        snapshots: Snapshots::Whole,
        ..plain
    };
    let owned = plain.owned_elems;
    // Its own parameters and Adam state, and its predecessor's, at 12 B per parameter.
    let state = 2 * 12 * owned;
    for p in candidates(Stage::Zero3) {
        let (without, with) = (evaluate(&plain, p, 1 << 16), evaluate(&d, p, 1 << 16));
        if p.any_nvme() {
            // Written to the tier a piece at a time: five 12 MiB pieces and two buffers.
            assert_eq!(
                with.per_rank.backup,
                5 * 12 * (1 << 20) + 2 * (1 << 20),
                "{p:?}"
            );
            assert_eq!(with.per_rank.backup_disk, 2 * state, "{p:?}");
        } else {
            assert_eq!(with.per_rank.backup, state, "{p:?}");
            assert_eq!(with.per_rank.backup_disk, 0, "{p:?}");
        }
        assert_eq!(with.snapshot_bytes, 12 * (1 << 24), "{p:?}");
        assert_eq!(
            with.process_bytes,
            without.process_bytes + 2 * with.per_rank.backup + with.snapshot_bytes
        );
    }
    // With too little memory for the whole snapshot the refusal says what it holds.
    let all_ram = evaluate(&plain, Placement::RAM, 1 << 16).process_bytes;
    let err = place(&d, &limits(Offload::Auto, Offload::Auto, all_ram / 2)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("a checkpoint holds 192.0 MiB"), "{msg}");
    // Backups in RAM that do not fit: offloading moves them to the tier, and a budget
    // only the placements without backups meet names --replicate-every 0.
    let no_snap = Demand {
        snapshots: Snapshots::None,
        ..d
    };
    let fit = place(&no_snap, &limits(Offload::Auto, Offload::Auto, all_ram)).unwrap();
    assert!(fit.placement.any_nvme(), "{fit:?}");
    let least = |d: &Demand| {
        candidates(Stage::Zero3)
            .into_iter()
            .map(|p| evaluate(d, p, MIN_TILE_ELEMS).process_bytes)
            .min()
            .unwrap()
    };
    let budget = least(&plain);
    assert!(budget < least(&no_snap));
    let hint = place(&no_snap, &limits(Offload::Auto, Offload::Auto, budget))
        .unwrap_err()
        .to_string();
    assert!(hint.contains("--replicate-every 0"), "{hint}");
}

#[test]
fn a_snapshot_streamed_off_the_tier_holds_a_few_pieces_whatever_the_model() {
    for total in [1u64 << 24, 1 << 30] {
        let d = Demand {
            snapshots: Snapshots::StreamedOffTier,
            ..demand(Stage::Zero3, total, 2)
        };
        let nvme = Placement {
            optimizer: Tier::Nvme,
            params: Tier::Nvme,
            grads: Tier::Nvme,
        };
        let off = evaluate(&d, nvme, 1 << 16);
        // One piece per rank being merged, one queued, one being written; two buffers.
        assert_eq!(off.snapshot_bytes, 4 * 12 * (1 << 20) + 2 * (1 << 20));
        // In RAM it is gathered whole, as before.
        let ram = evaluate(&d, Placement::RAM, 1 << 16);
        assert_eq!(ram.snapshot_bytes, 12 * total);
    }
}

#[test]
fn bf16_stages_0_to_2_keep_a_bf16_copy_and_put_the_owned_masters_with_the_optimizer() {
    let fp32 = demand(Stage::Zero1, 1 << 24, 4);
    let bf16 = Demand {
        param_copy_bytes: 2,
        compute_bytes: uniform_compute(Stage::Zero1, (1 << 24) / 10, 2),
        ..fp32
    };
    let (total, owned, unit) = (1u64 << 24, 1u64 << 22, (1u64 << 24) / 10);
    let ram = evaluate(&bf16, Placement::RAM, DEFAULT_TILE_ELEMS).per_rank;
    assert_eq!(ram.params, 2 * total);
    assert_eq!(ram.optimizer, 12 * owned);
    let ram32 = evaluate(&fp32, Placement::RAM, DEFAULT_TILE_ELEMS).per_rank;
    assert_eq!((ram32.params, ram32.optimizer), (4 * total, 8 * owned));
    // One unit widened from the bf16 copy per live unit, beside what fp32 needs.
    assert_eq!(ram.working, ram32.working + 4 * unit * 2);
    // Offloading the optimizer moves the masters to the tier with m and v.
    let opt = Placement {
        optimizer: Tier::Nvme,
        ..Placement::RAM
    };
    let kinds = opt.kinds(Stage::Zero1, 2, 2);
    assert_eq!((kinds.params, kinds.state), (true, 2));
    assert!(!opt.kinds(Stage::Zero1, 2, 4).params);
    let off = evaluate(&bf16, opt, DEFAULT_TILE_ELEMS).per_rank;
    assert_eq!((off.optimizer, off.tier), (0, 12 * owned));
    // Stage 3 is unchanged: its fp32 shard is the master and its parameters.
    let s3 = Demand {
        stage: Stage::Zero3,
        compute_bytes: uniform_compute(Stage::Zero3, (1 << 24) / 10, 2),
        ..bf16
    };
    let s3_32 = Demand {
        stage: Stage::Zero3,
        compute_bytes: uniform_compute(Stage::Zero3, (1 << 24) / 10, 4),
        ..fp32
    };
    let (a, b) = (
        evaluate(&s3, Placement::RAM, DEFAULT_TILE_ELEMS).per_rank,
        evaluate(&s3_32, Placement::RAM, DEFAULT_TILE_ELEMS).per_rank,
    );
    assert_eq!(a, b);
}
