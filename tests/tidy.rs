//! Tidy: the source tree keeps the shape docs/layout.md draws.
//!
//! - `plan/` and `engine/` do no I/O: they never name the runtime, tokio, ractor, quinn or
//!   `std::net`.
//! - Every module of the library belongs to a part in `LAYERS`, listed bottom first; a file
//!   imports only from its own part or parts below it.
//! - Imports point one way between siblings: within every folder, the files and sub-folders it
//!   holds never import each other in a circle (a folder's `mod.rs` declaring and re-exporting
//!   its children is not an import, and test modules may reach across).
//! - No source file is over `FILE_LINES_MAX` lines, unless it is marked `@generated`.
//! - Every module under `src/` and `src/runtime/` is in a part, and the table in docs/layout.md
//!   has a row for each part, in `LAYERS`' order.
//!
//! It reads the source text (comments and string literals removed), so it sees `use` items and
//! paths written inline alike. Each finding names the file and line.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

mod scan;

use scan::{line_of, module_of, named_paths, resolve, strip, Named, Source};

/// The library's parts, bottom first. A module belongs to the longest entry that prefixes its
/// path; it may import its own part and the parts before it.
const LAYERS: &[&str] = &[
    "optim",
    "reduce",
    "model",
    "data",
    "param_digest",
    "plan",
    "config",
    "engine",
    "summary",
    "job",
    "reference",
    "net",
    "wire",
    "runtime::clock",
    "runtime::alloc",
    "runtime::storage",
    "runtime::transport",
    "runtime::meta",
    "runtime::step",
    "runtime::step::comm",
    "runtime::step::state",
    "runtime::step::elastic",
    "runtime::step::exec",
    "runtime::actors",
    "runtime::api",
    "runtime::procs",
    "checkpoint",
    "bench",
];

/// Parts that decide without doing: no I/O, no actors, no runtime.
const PURE_PARTS: &[&str] = &["plan", "engine"];
/// What a pure part may not name.
const IMPURE: &[&str] = &["crate::runtime", "tokio", "ractor", "quinn", "std::net"];

const FILE_LINES_MAX: usize = 1000;
/// A file with this in its first three lines is generated and exempt from `FILE_LINES_MAX`.
const GENERATED_MARKER: &str = "@generated";

/// Models and their layers compute only through their backend (the compute seam): they may not
/// name the CPU kernels behind it, only these shape and buffer helpers from those modules.
const MODEL_CODE: &[&str] = &["model::gpt", "model::mlp", "model::layers"];
const KERNEL_MODULES: &[&str] = &[
    "model::ops",
    "model::kernels",
    "model::attention",
    "model::gemm",
    "optim",
];
const KERNEL_HELPERS: &[&str] = &[
    "split_params",
    "split_params_mut",
    "check_len",
    "AttnShape",
    "Layout",
];

/// Folders holding Rust sources, relative to the repository root.
const SOURCE_DIRS: &[&str] = &["src", "tests", "examples", "benches", "chaos-tests"];

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Finding {
    file: PathBuf,
    line: usize,
    what: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.what)
    }
}

fn part_of(module: &[String]) -> Option<usize> {
    let joined = module.join("::");
    LAYERS
        .iter()
        .enumerate()
        .filter(|(_, l)| joined == **l || joined.starts_with(&format!("{l}::")))
        .max_by_key(|(_, l)| l.len())
        .map(|(k, _)| k)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Everything untidy under `root` (a repository root).
fn check(root: &Path) -> Vec<Finding> {
    let src_dir = root.join("src");
    let mut findings = Vec::new();
    let sources = read_sources(root, &src_dir, &mut findings);
    // (folder module, child a, child b) -> where a imports b.
    let mut edges: BTreeMap<(Vec<String>, String, String), (PathBuf, usize)> = BTreeMap::new();
    for s in &sources {
        let mine = if s.in_bin { None } else { part_of(&s.module) };
        let pure = mine.is_some_and(|p| PURE_PARTS.iter().any(|x| LAYERS[p] == *x));
        for named in named_paths(&src_dir, s) {
            if pure {
                findings.extend(impure_use(s, mine, &named));
            }
            if !named.local || s.in_bin {
                continue;
            }
            findings.extend(kernel_bypass(s, &named));
            let Some((_, target)) = resolve(&src_dir, &named.segs) else {
                continue;
            };
            // A parent naming its own children (declaring, re-exporting) is not layering.
            if target.starts_with(&s.module) {
                continue;
            }
            findings.extend(layer_inversion(s, mine, &target, &named));
            let common = s
                .module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common < s.module.len() && common < target.len() && !named.in_test {
                edges
                    .entry((
                        s.module[..common].to_vec(),
                        s.module[common].clone(),
                        target[common].clone(),
                    ))
                    .or_insert((s.rel.clone(), named.line));
            }
        }
    }
    findings.extend(circles(&edges));
    findings.sort();
    findings.dedup();
    findings
}

/// Every Rust file under the source folders, stripped for scanning (those under `src/` only);
/// a file over the size limit is a finding.
fn read_sources(root: &Path, src_dir: &Path, findings: &mut Vec<Finding>) -> Vec<Source> {
    let mut all = Vec::new();
    for d in SOURCE_DIRS {
        rust_files(&root.join(d), &mut all);
    }
    let mut sources = Vec::new();
    for path in &all {
        let rel = path.strip_prefix(root).unwrap_or(path).to_path_buf();
        let raw = fs::read_to_string(path).unwrap_or_default();
        let lines = raw.lines().count();
        // Machine-written files (bindgen output) say so at the top and are not split by hand.
        let generated = raw.lines().take(3).any(|l| l.contains(GENERATED_MARKER));
        if lines > FILE_LINES_MAX && !generated {
            findings.push(Finding {
                file: rel.clone(),
                line: FILE_LINES_MAX + 1,
                what: format!(
                    "{lines} lines, over {FILE_LINES_MAX}: split it where its concepts separate"
                ),
            });
        }
        let Ok(in_src) = path.strip_prefix(src_dir) else {
            continue;
        };
        let in_bin = in_src.starts_with("cli") || in_src == Path::new("main.rs");
        sources.push(Source {
            rel,
            module: module_of(in_src),
            in_bin,
            text: strip(&raw),
        });
    }
    sources
}

/// A path a pure layer (plan, engine; `mine`) names that does I/O or reaches the runtime.
fn impure_use(s: &Source, mine: Option<usize>, named: &Named) -> Option<Finding> {
    let full = named.segs.join("::");
    let shown = if named.local {
        format!("crate::{full}")
    } else {
        full
    };
    let bad = IMPURE
        .iter()
        .find(|x| shown == **x || shown.starts_with(&format!("{x}::")))?;
    Some(Finding {
        file: s.rel.clone(),
        line: named.line,
        what: format!(
            "`{shown}`: {} may not use `{bad}` (plan and engine are pure: \
             events and time in, commands out; the runtime does the I/O)",
            LAYERS[mine.unwrap_or(0)]
        ),
    })
}

/// Model code calling a kernel module directly (other than its shared helpers) instead of
/// through its backend.
fn kernel_bypass(s: &Source, named: &Named) -> Option<Finding> {
    let full = named.segs.join("::");
    let in_model = MODEL_CODE.iter().any(|m| s.module.join("::") == *m);
    let kernel = KERNEL_MODULES
        .iter()
        .find(|k| full.starts_with(&format!("{k}::")));
    let helper = named
        .segs
        .last()
        .is_some_and(|l| KERNEL_HELPERS.contains(&l.as_str()));
    let (true, false, Some(k), false) = (in_model, named.in_test, kernel, helper) else {
        return None;
    };
    Some(Finding {
        file: s.rel.clone(),
        line: named.line,
        what: format!(
            "`{full}`: {} computes through its backend (`model::backend`), not \
             `{k}` directly, so a device backend runs all of it",
            s.module.join("::")
        ),
    })
}

/// `s` (in layer `mine`) naming `target` in a layer above it.
fn layer_inversion(
    s: &Source,
    mine: Option<usize>,
    target: &[String],
    named: &Named,
) -> Option<Finding> {
    let (mine, theirs) = (mine?, part_of(target)?);
    if theirs <= mine {
        return None;
    }
    Some(Finding {
        file: s.rel.clone(),
        line: named.line,
        what: format!(
            "`{}` imports `{}`, but {} sits above {} in the declared order \
             (LAYERS in tests/tidy.rs; docs/layout.md): move the shared item down",
            s.module.join("::"),
            named.segs.join("::"),
            LAYERS[theirs],
            LAYERS[mine]
        ),
    })
}

/// Circles among the children of each folder, one finding per circle.
fn circles(edges: &BTreeMap<(Vec<String>, String, String), (PathBuf, usize)>) -> Vec<Finding> {
    let mut by_folder: BTreeMap<&Vec<String>, BTreeMap<&String, BTreeSet<&String>>> =
        BTreeMap::new();
    for (folder, a, b) in edges.keys() {
        by_folder
            .entry(folder)
            .or_default()
            .entry(a)
            .or_default()
            .insert(b);
    }
    let mut out = Vec::new();
    let mut seen: BTreeSet<Vec<String>> = BTreeSet::new();
    for (folder, graph) in &by_folder {
        for start in graph.keys() {
            // Depth-first search for a path back to `start`.
            let mut stack = vec![(vec![*start], graph.get(start).cloned().unwrap_or_default())];
            while let Some((path, mut next)) = stack.pop() {
                let Some(n) = next.pop_first() else {
                    continue;
                };
                stack.push((path.clone(), next));
                if n == *start {
                    let mut key: Vec<String> = path.iter().map(|s| s.to_string()).collect();
                    key.sort();
                    if !seen.insert(key) {
                        continue;
                    }
                    // Each hop of the circle, back to `start`, with where it is imported.
                    let hops: Vec<_> = path
                        .iter()
                        .zip(path.iter().skip(1).chain([start]))
                        .map(|(a, b)| {
                            (
                                *a,
                                *b,
                                &edges[&((*folder).clone(), (*a).clone(), (*b).clone())],
                            )
                        })
                        .collect();
                    let (file, line) = hops[0].2.clone();
                    let hops: Vec<String> = hops
                        .iter()
                        .map(|(a, b, (f, l))| format!("{a} -> {b} ({}:{l})", f.display()))
                        .collect();
                    out.push(Finding {
                        file,
                        line,
                        what: format!(
                            "import circle in `{}`: {}; move the shared type to the lower file",
                            if folder.is_empty() {
                                "crate".into()
                            } else {
                                folder.join("::")
                            },
                            hops.join(", ")
                        ),
                    });
                } else if !path.contains(&n) && path.len() < 16 {
                    let mut p = path.clone();
                    p.push(n);
                    stack.push((p, graph.get(n).cloned().unwrap_or_default()));
                }
            }
        }
    }
    out
}

/// The document whose table lists the parts, one row each, in `LAYERS`' order.
const LAYOUT_DOC: &str = "docs/layout.md";

/// Where `LAYERS` and the tree or the layout table (`LAYOUT_DOC`) disagree: a part that is not a
/// module, a module in no part, a part the table leaves out or lists out of order.
fn layout_table(root: &Path, layers: &[&str]) -> Vec<Finding> {
    let src = root.join("src");
    let mut findings = Vec::new();
    let finding = |file: &str, line: usize, what: String| Finding {
        file: PathBuf::from(file),
        line,
        what,
    };
    let mut rows = Vec::new();
    for layer in layers {
        let segs: Vec<String> = layer.split("::").map(String::from).collect();
        match resolve(&src, &segs) {
            Some((file, module)) if module == segs => {
                let rel = file.strip_prefix(root).unwrap_or(&file).to_path_buf();
                let shown = if rel.ends_with("mod.rs") {
                    format!("{}/", rel.parent().unwrap_or(&rel).display())
                } else {
                    rel.display().to_string()
                };
                rows.push((layer, shown));
            }
            _ => findings.push(finding(
                "tests/tidy.rs",
                1,
                format!("LAYERS names `{layer}`, which is no module under src/"),
            )),
        }
    }
    // Every module directly under src/ and src/runtime/ belongs to a part.
    for dir in [src.clone(), src.join("runtime")] {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        let mut names: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        names.sort();
        for path in names {
            let Ok(rel) = path.strip_prefix(&src) else {
                continue;
            };
            let module = module_of(&if path.is_dir() {
                rel.join("mod.rs")
            } else {
                rel.to_path_buf()
            });
            let joined = module.join("::");
            let skip = module.is_empty() || joined == "cli" || joined == "runtime";
            let is_module = path.is_dir() || path.extension().is_some_and(|e| e == "rs");
            let covered = layers.iter().any(|l| {
                *l == joined
                    || l.starts_with(&format!("{joined}::"))
                    || joined.starts_with(&format!("{l}::"))
            });
            if is_module && !skip && !covered {
                findings.push(finding(
                    &format!("src/{}", rel.display()),
                    1,
                    format!(
                        "`{joined}` is in no part: add it to LAYERS (tests/tidy.rs) where its \
                         imports put it, and a row to the table in {LAYOUT_DOC}"
                    ),
                ));
            }
        }
    }
    // The table is docs/layout.md's; a row starts with its part's path.
    let table = fs::read_to_string(root.join(LAYOUT_DOC)).unwrap_or_default();
    let mut last = 0;
    for (layer, shown) in rows {
        match table.find(&format!("| `{shown}`")) {
            Some(at) if at >= last => last = at,
            Some(at) => findings.push(finding(
                LAYOUT_DOC,
                line_of(&table, at),
                format!("the layout table lists `{shown}` ({layer}) before a part below it; keep LAYERS' order"),
            )),
            None => findings.push(finding(
                LAYOUT_DOC,
                1,
                format!("the layout table has no row for `{shown}` ({layer})"),
            )),
        }
    }
    findings
}

#[test]
fn the_readme_layout_matches_the_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let findings = layout_table(root, LAYERS);
    for f in &findings {
        eprintln!("{f}");
    }
    assert!(
        findings.is_empty(),
        "{} layout findings (above)",
        findings.len()
    );
}

#[test]
fn the_tree_is_tidy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let findings = check(root);
    for f in &findings {
        eprintln!("{f}");
    }
    assert!(
        findings.is_empty(),
        "{} tidy findings (above)",
        findings.len()
    );
}

mod planted;

mod fn_length;

#[test]
fn functions_are_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let findings = fn_length::long_functions(root);
    for f in &findings {
        eprintln!("{f}");
    }
    assert!(
        findings.is_empty(),
        "{} functions over {} lines (above)",
        findings.len(),
        fn_length::FN_LINES_MAX
    );
}

mod clock;

#[test]
fn time_is_read_on_the_injected_clock() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let findings = clock::clock_findings(root);
    for f in &findings {
        eprintln!("{f}");
    }
    assert!(
        findings.is_empty(),
        "{} clock findings (above)",
        findings.len()
    );
}
