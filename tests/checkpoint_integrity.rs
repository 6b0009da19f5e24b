//! What checkpoint verification refuses, each with exit 2 and one line naming the file (damaged,
//! incomplete or foreign checkpoints, and sound ones that do not fit the run), and what it must
//! not refuse: an older build's manifest, a resume that changes only fault injection.

use crate::common;

use std::path::Path;

use common::ezero::{copy_dir, edit, ezero, ok, refused, s, step_dir, train_cli};
use elastic_zero::checkpoint::{self, CheckpointError, Manifest};

#[test]
fn damaged_incomplete_or_foreign_checkpoints_are_refused_with_exit_2() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&["--steps", "4"])).sha();
    ok(&train_cli(&[
        "--steps",
        "4",
        "--ranks",
        "4",
        "--save-dir",
        s(&root),
        "--save-every",
        "2",
    ]));
    let good = step_dir(&root, 4);
    each_damage_is_refused_by_verify_resume_and_export(t.path(), &good);
    a_checkpoint_that_does_not_exist_is_refused(t.path());
    sound_checkpoints_that_do_not_fit_the_run_are_refused(&good);
    a_damaged_newest_is_refused_unless_falling_back(&root, &good, &want);
}

type Damage = fn(&Path);

/// Each damage done to a checkpoint: its name, what it does, the file the refusal names and
/// what it says.
fn damages() -> Vec<(&'static str, Damage, &'static str, &'static str)> {
    vec![
        (
            "truncated",
            |d| edit(&d.join("rank-00001.bin"), |b| b.truncate(b.len() - 4)),
            "rank-00001.bin",
            "truncated",
        ),
        (
            "flipped",
            |d| {
                edit(&d.join("rank-00002.bin"), |b| {
                    let n = b.len() / 2;
                    b[n] ^= 0x10
                })
            },
            "rank-00002.bin",
            "checksum mismatch in chunk",
        ),
        (
            "missing-file",
            |d| std::fs::remove_file(d.join("rank-00000.bin")).unwrap(),
            "rank-00000.bin",
            "missing",
        ),
        (
            "manifest-edit",
            |d| {
                edit(&d.join("manifest.json"), |b| {
                    let text = String::from_utf8(b.clone()).unwrap().replacen(
                        "\"step\": 4",
                        "\"step\": 5",
                        1,
                    );
                    *b = text.into_bytes();
                })
            },
            "manifest.json",
            "manifest checksum mismatch",
        ),
        (
            "manifest-garbage",
            |d| edit(&d.join("manifest.json"), |b| b.truncate(b.len() / 2)),
            "manifest.json",
            "not a valid manifest",
        ),
        (
            "in-progress",
            |d| std::fs::rename(d.join("manifest.json"), d.join("manifest.json.tmp")).unwrap(),
            "step-00000004",
            "incomplete checkpoint",
        ),
    ]
}

/// Every damage, each to its own copy of `good` under `tmp`.
fn each_damage_is_refused_by_verify_resume_and_export(tmp: &Path, good: &Path) {
    for (name, damage, file, what) in damages() {
        let dir = tmp.join(name).join("step-00000004");
        copy_dir(good, &dir);
        damage(&dir);
        refused(&ezero(&["checkpoint", "verify", s(&dir)]), file, what);
        refused(&ezero(&["train", "--resume", s(&dir)]), file, what);
        refused(
            &ezero(&[
                "checkpoint",
                "export",
                s(&dir),
                "--out",
                s(&tmp.join("x.safetensors")),
            ]),
            file,
            what,
        );
    }
}

fn a_checkpoint_that_does_not_exist_is_refused(tmp: &Path) {
    refused(
        &ezero(&["checkpoint", "verify", s(&tmp.join("nope"))]),
        "nope",
        "does not exist",
    );
    refused(
        &ezero(&["train", "--resume", s(&tmp.join("nope"))]),
        "nope",
        "does not exist",
    );
}

fn sound_checkpoints_that_do_not_fit_the_run_are_refused(good: &Path) {
    refused(
        &ezero(&["train", "--resume", s(good), "--d-model", "32"]),
        "manifest.json",
        "another model",
    );
    refused(
        &ezero(&["train", "--resume", s(good), "--steps", "8"]),
        "manifest.json",
        "`steps` is 4",
    );
    refused(
        &ezero(&["train", "--resume", s(good), "--seed", "1"]),
        "manifest.json",
        "`seed`",
    );
}

/// The newest checkpoint (`good`) damaged: refused, unless falling back (to step 2, which ends
/// with `want`) is asked for.
fn a_damaged_newest_is_refused_unless_falling_back(root: &Path, good: &Path, want: &str) {
    edit(&good.join("rank-00003.bin"), |b| b[0] ^= 1);
    refused(
        &ezero(&["train", "--resume", s(root)]),
        "rank-00003.bin",
        "checksum mismatch",
    );
    let r = ezero(&[
        "train",
        "--resume",
        s(root),
        "--latest-valid",
        "--ranks",
        "3",
    ]);
    assert!(ok(&r).stdout.contains("at step 2 "), "{}", r.stdout);
    assert!(
        r.stderr.contains("skipped") && r.stderr.contains("rank-00003.bin"),
        "{}",
        r.stderr
    );
    assert_eq!(&r.sha(), want);
}

/// Seals manifest text the way every build's writer does: `manifest_crc32` is the CRC-32 of the
/// file's bytes with that value empty.
fn reseal(text: &str) -> String {
    let key = "\"manifest_crc32\": \"";
    let start = text.find(key).expect("a manifest_crc32 field") + key.len();
    let end = start + text[start..].find('"').unwrap();
    let blank = format!("{}{}", &text[..start], &text[end..]);
    let crc = crc32fast::hash(blank.as_bytes());
    format!("{}{crc:08x}{}", &text[..start], &text[end..])
}

/// A 2-rank run of 4 steps saving at steps 2 and 4; returns the step-2 checkpoint.
fn saved_run(root: &Path) -> std::path::PathBuf {
    ok(&train_cli(&[
        "--steps",
        "4",
        "--ranks",
        "2",
        "--save-dir",
        s(root),
        "--save-every",
        "2",
    ]));
    step_dir(root, 2)
}

#[test]
fn an_older_builds_manifest_without_a_newer_config_key_verifies_and_resumes() {
    let t = tempfile::tempdir().unwrap();
    let want = ok(&train_cli(&["--steps", "4"])).sha();
    let dir = saved_run(&t.path().join("ck"));
    let path = dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        reseal(&text),
        text,
        "the writer hashes its file with the value blank"
    );
    // And the file is the plain serialization of the sealed manifest, as every build wrote it.
    let sealed: Manifest = serde_json::from_str(&text).unwrap();
    assert_eq!(serde_json::to_string_pretty(&sealed).unwrap() + "\n", text);
    // An older build did not know `keep_activations`; its default is what that build did.
    let old = text.replacen("\n    \"keep_activations\": false,", "", 1);
    assert_ne!(old, text, "no `keep_activations: false` line in:\n{text}");
    std::fs::write(&path, reseal(&old)).unwrap();
    ok(&ezero(&["checkpoint", "verify", s(&dir)]));
    let loaded = checkpoint::load(&dir).unwrap();
    assert!(!loaded.manifest.config.keep_activations);
    let r = ezero(&[
        "train",
        "--resume",
        s(&dir),
        "--ranks",
        "3",
        "--save-every",
        "0",
    ]);
    assert!(ok(&r).stdout.contains("at step 2 "), "{}", r.stdout);
    assert_eq!(r.sha(), want);
}

#[test]
fn a_manifest_with_any_bit_flipped_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let path = saved_run(&t.path().join("ck")).join("manifest.json");
    let bytes = std::fs::read(&path).unwrap();
    Manifest::decode(&path, &bytes).unwrap();
    for i in 0..bytes.len() {
        for bit in [0x01u8, 0x04, 0x20, 0x80] {
            let mut b = bytes.clone();
            b[i] ^= bit;
            match Manifest::decode(&path, &b) {
                Err(CheckpointError::Corrupt { .. }) => {}
                other => panic!(
                    "byte {i} ({:?}) ^ {bit:#04x}: {:?}",
                    bytes[i] as char,
                    other.map(|m| m.step)
                ),
            }
        }
    }
}

#[test]
fn a_resume_may_drop_or_change_a_kill_during_a_round() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let want = ok(&train_cli(&["--steps", "6", "--ranks", "2"])).sha();
    let r = train_cli(&[
        "--steps",
        "6",
        "--ranks",
        "4",
        "--kill-during",
        "3@2:replicate",
        "--save-dir",
        s(&root),
        "--save-every",
        "4",
    ]);
    assert_eq!(
        ok(&r).sha(),
        want,
        "the injected kill does not change the numbers"
    );
    assert!(r.stdout.contains("lost ranks [3]"), "{}", r.stdout);
    let at4 = step_dir(&root, 4);
    // The saved kill (step 2) is past, so a resume drops it; it may also inject another.
    for (extra, lost) in [
        (&[][..], false),
        (&["--kill-during", "0@5:replicate"][..], true),
    ] {
        let mut args = vec![
            "train",
            "--resume",
            s(&at4),
            "--ranks",
            "3",
            "--save-every",
            "0",
        ];
        args.extend_from_slice(extra);
        let r = ezero(&args);
        assert!(
            ok(&r).stdout.contains("at step 4 "),
            "{extra:?}: {}",
            r.stdout
        );
        assert_eq!(r.sha(), want, "{extra:?}");
        assert_eq!(r.stdout.contains("lost ranks [0]"), lost, "{}", r.stdout);
    }
}
