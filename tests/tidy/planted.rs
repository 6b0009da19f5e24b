//! Small trees with one violation of each kind, so the checks of `tidy.rs` are known to bite.

use super::*;

fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for (path, text) in files {
        let p = dir.path().join(path);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(p, text).expect("write");
    }
    dir
}

fn findings(files: &[(&str, &str)]) -> Vec<String> {
    let dir = tree(files);
    check(dir.path()).iter().map(|f| f.to_string()).collect()
}

#[test]
fn an_engine_that_does_io_is_refused() {
    let found = findings(&[
        ("src/lib.rs", "pub mod engine;\npub mod runtime;\n"),
        ("src/engine/mod.rs", "//! x\n\nuse std::net::TcpStream;\n"),
        ("src/runtime/mod.rs", ""),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("src/engine/mod.rs:3: `std::net::TcpStream`"),
        "{found:?}"
    );
}

#[test]
fn a_plan_that_names_the_runtime_inline_is_refused() {
    let found = findings(&[
        ("src/plan/mod.rs", "pub mod shard;\n"),
        (
            "src/plan/shard.rs",
            "fn f() {\n    let _ = \"crate::runtime in a string is fine\";\n    crate::runtime::clock::now();\n    // tokio::spawn in a comment is fine\n}\n",
        ),
        ("src/runtime/clock.rs", "pub fn now() {}\n"),
        ("src/runtime/mod.rs", "pub mod clock;\n"),
    ]);
    assert!(
        found.iter().any(|f| f.starts_with("src/plan/shard.rs:3:")),
        "{found:?}"
    );
    assert!(
        !found.iter().any(|f| f.contains(":2:") || f.contains(":4:")),
        "{found:?}"
    );
}

#[test]
fn an_import_from_a_higher_part_is_refused() {
    let found = findings(&[
        ("src/runtime/mod.rs", "pub mod step;\npub mod api;\n"),
        ("src/runtime/step/mod.rs", "pub mod comm;\n"),
        (
            "src/runtime/step/comm.rs",
            "use crate::runtime::api::cluster::Observer;\n",
        ),
        ("src/runtime/api/mod.rs", "pub mod cluster;\n"),
        ("src/runtime/api/cluster.rs", "pub trait Observer {}\n"),
    ]);
    assert!(
        found
            .iter()
            .any(|f| f.starts_with("src/runtime/step/comm.rs:1:")
                && f.contains("runtime::api sits above runtime::step")),
        "{found:?}"
    );
}

/// The step's parts under the real `LAYERS`: `state` reaching up into `elastic`, which already
/// imports it, is both a layer inversion and a circle between the folders.
#[test]
fn step_folders_importing_each_other_are_refused() {
    let found = findings(&[
        ("src/runtime/mod.rs", "pub mod step;\n"),
        ("src/runtime/step/mod.rs", "pub mod elastic;\npub mod state;\n"),
        ("src/runtime/step/state/mod.rs", "pub mod rank_state;\n"),
        (
            "src/runtime/step/state/rank_state.rs",
            "pub struct RankState;\nfn f() { let _ = crate::runtime::step::elastic::replica::Backup; }\n",
        ),
        ("src/runtime/step/elastic/mod.rs", "pub mod replica;\n"),
        (
            "src/runtime/step/elastic/replica.rs",
            "use crate::runtime::step::state::rank_state::RankState;\npub struct Backup;\n",
        ),
    ]);
    for f in &found {
        eprintln!("{f}");
    }
    assert!(
        found
            .iter()
            .any(|f| f.starts_with("src/runtime/step/state/rank_state.rs:2:")
                && f.contains("runtime::step::elastic sits above runtime::step::state")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|f| f.contains("import circle in `runtime::step`: elastic -> state")),
        "{found:?}"
    );
}

#[test]
fn siblings_importing_each_other_are_a_circle() {
    let found = findings(&[
        ("src/wire/mod.rs", "mod a;\nmod b;\n"),
        ("src/wire/a.rs", "use super::b::B;\npub struct A;\n"),
        (
            "src/wire/b.rs",
            "pub struct B;\nfn f() { let _ = super::a::A; }\n",
        ),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains(
            "import circle in `wire`: a -> b (src/wire/a.rs:1), b -> a (src/wire/b.rs:2)"
        ),
        "{found:?}"
    );
}

#[test]
fn a_test_module_inside_a_file_resolves_super_to_the_file() {
    let found = findings(&[
        ("src/wire/mod.rs", "mod a;\nmod b;\n"),
        (
            "src/wire/a.rs",
            "use super::b::B;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        ("src/wire/b.rs", "pub struct B;\n"),
    ]);
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn a_long_file_is_refused() {
    let long = "fn f() {}\n".repeat(FILE_LINES_MAX + 1);
    let found = findings(&[("src/plan/mod.rs", &long)]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("src/plan/mod.rs:1001: 1001 lines"),
        "{found:?}"
    );
    // Unless a tool wrote it and says so at the top.
    let generated = format!("//! @generated by bindgen\n{long}");
    assert!(findings(&[("src/plan/mod.rs", &generated)]).is_empty());
}

#[test]
fn the_layout_table_follows_the_layers_and_the_tree() {
    let dir = tree(&[
        ("src/plan/mod.rs", ""),
        ("src/engine/mod.rs", ""),
        ("src/extra.rs", ""),
        (
            "docs/layout.md",
            "# x\n\n## Parts\n\n| `src/engine/` | e |\n| `src/plan/` | p |\n\n## Next\n",
        ),
    ]);
    let found: Vec<String> = layout_table(dir.path(), &["plan", "engine", "runtime::gone"])
        .iter()
        .map(|f| f.to_string())
        .collect();
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(
        found[0].starts_with("tests/tidy.rs:1: LAYERS names `runtime::gone`"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with("src/extra.rs:1: `extra` is in no part"),
        "{found:?}"
    );
    assert!(
        found[2]
            .starts_with("docs/layout.md:5: the layout table lists `src/engine/` (engine) before"),
        "{found:?}"
    );
}

#[test]
fn a_model_calling_a_kernel_around_its_backend_is_refused() {
    let found = findings(&[
        ("src/lib.rs", "pub mod model;\npub mod optim;\n"),
        (
            "src/model/mod.rs",
            "pub mod backend;\npub mod gpt;\npub mod ops;\n",
        ),
        ("src/model/backend.rs", ""),
        ("src/optim.rs", ""),
        (
            "src/model/ops.rs",
            "pub fn split_params() {}\npub fn cross_entropy() {}\n",
        ),
        (
            "src/model/gpt.rs",
            "use super::ops::{cross_entropy, split_params};\nuse crate::optim::adam;\n",
        ),
    ]);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with("src/model/gpt.rs:1: `model::ops::cross_entropy`"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with("src/model/gpt.rs:2: `optim::adam`"),
        "{found:?}"
    );
}
