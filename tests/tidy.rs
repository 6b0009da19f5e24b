//! Tidy: the source tree keeps the shape the README's "Layout" section draws.
//!
//! - `plan/` and `engine/` do no I/O: they never name the runtime, tokio, ractor, quinn or
//!   `std::net`.
//! - Every module of the library belongs to a part in `LAYERS`, listed bottom first; a file
//!   imports only from its own part or parts below it.
//! - Imports point one way between siblings: within every folder, the files and sub-folders it
//!   holds never import each other in a circle (a folder's `mod.rs` declaring and re-exporting
//!   its children is not an import, and test modules may reach across).
//! - No source file is over `FILE_LINES_MAX` lines, unless it is marked `@generated`.
//! - Every module under `src/` and `src/runtime/` is in a part, and the README's "Layout" table
//!   has a row for each part, in `LAYERS`' order.
//!
//! It reads the source text (comments and string literals removed), so it sees `use` items and
//! paths written inline alike. Each finding names the file and line.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

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
    "runtime::step",
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

/// One path a file names: its segments, made absolute where it is the crate's own.
#[derive(Debug, Clone)]
struct Named {
    segs: Vec<String>,
    /// Starts at this crate's root (`crate::`, `super::`, `self::` or a child module).
    local: bool,
    /// Named from test code (a `tests` module), which may reach across siblings.
    in_test: bool,
    line: usize,
}

/// Source text with comments, string and char literals blanked (newlines kept, so offsets
/// still give line numbers).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == b'/' && next == Some(b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && next == Some(b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend(b"  ");
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(next, Some(b'"') | Some(b'#')) && !ident_before(b, i) {
            // Raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            while b.get(j) == Some(&b'#') {
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            let mut k = j + 1;
            while k < b.len() {
                if b[k] == b'"'
                    && b[k + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    k += 1 + hashes;
                    break;
                }
                k += 1;
            }
            for &x in &b[i..k.min(b.len())] {
                blank(&mut out, x);
            }
            i = k;
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some(b'\\') {
                let mut k = i + 2;
                while k < b.len() && b[k] != b'\'' {
                    k += 1;
                }
                for &x in &b[i..=k.min(b.len() - 1)] {
                    blank(&mut out, x);
                }
                i = k + 1;
            } else if b.get(i + 2) == Some(&b'\'') || multibyte_char(b, i) {
                let len = char_len(b, i + 1);
                out.extend(std::iter::repeat_n(b' ', len + 2));
                i += len + 2;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

fn char_len(b: &[u8], i: usize) -> usize {
    match b.get(i) {
        Some(&x) if x >= 0xF0 => 4,
        Some(&x) if x >= 0xE0 => 3,
        Some(&x) if x >= 0xC0 => 2,
        _ => 1,
    }
}

fn multibyte_char(b: &[u8], i: usize) -> bool {
    let len = char_len(b, i + 1);
    len > 1 && b.get(i + 1 + len) == Some(&b'\'')
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].bytes().filter(|&c| c == b'\n').count() + 1
}

/// Expands a `use` tree (`a::{b, c::{d, e as f}, self}`) into its paths.
fn expand_use(tree: &str) -> Vec<Vec<String>> {
    fn go(prefix: &[String], s: &str, out: &mut Vec<Vec<String>>) {
        let s = s.trim();
        if s.is_empty() {
            return;
        }
        if let Some(open) = s.find('{') {
            let head: Vec<String> = s[..open]
                .split("::")
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .map(String::from)
                .collect();
            let close = s.rfind('}').unwrap_or(s.len());
            let inner = &s[open + 1..close];
            let mut base = prefix.to_vec();
            base.extend(head);
            let mut depth = 0;
            let mut start = 0;
            for (k, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        go(&base, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            go(&base, &inner[start..], out);
        } else {
            let s = s.split(" as ").next().unwrap_or(s);
            let mut p = prefix.to_vec();
            p.extend(
                s.split("::")
                    .map(str::trim)
                    .filter(|x| !x.is_empty() && *x != "self")
                    .map(String::from),
            );
            out.push(p);
        }
    }
    let mut out = Vec::new();
    go(&[], tree, &mut out);
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// A source file of the library (or of the binary's `cli`), with its module path.
struct Source {
    rel: PathBuf,
    module: Vec<String>,
    /// `crate::` in this file means the binary, whose modules all sit above the library.
    in_bin: bool,
    text: String,
}

/// The module path of a file under `src/` (`runtime/step/comm.rs` -> runtime::step::comm).
fn module_of(rel_to_src: &Path) -> Vec<String> {
    let mut segs: Vec<String> = rel_to_src
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = segs.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs").to_string();
    if stem != "mod" && stem != "lib" && stem != "main" {
        segs.push(stem);
    }
    segs
}

/// The deepest file of the library a module path lands in, and its module path.
fn resolve(src: &Path, segs: &[String]) -> Option<(PathBuf, Vec<String>)> {
    let mut dir = src.to_path_buf();
    let mut found = None;
    for (k, seg) in segs.iter().enumerate() {
        let file = dir.join(format!("{seg}.rs"));
        let folder = dir.join(seg).join("mod.rs");
        if file.is_file() {
            found = Some((file, segs[..=k].to_vec()));
        } else if folder.is_file() {
            found = Some((folder, segs[..=k].to_vec()));
        } else {
            break;
        }
        dir = dir.join(seg);
    }
    found
}

/// Every path a file names, with `super::`/`self::`/child-module paths made absolute.
fn named_paths(src_dir: &Path, source: &Source) -> Vec<Named> {
    let text = &source.text;
    let b = text.as_bytes();
    let mut found = Vec::new();
    // Inline modules open at these brace depths (`mod tests { .. }`).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let scope = |inline: &[(String, usize)]| {
        let mut m = source.module.clone();
        m.extend(inline.iter().map(|(n, _)| n.clone()));
        m
    };
    let absolute = |scope: &[String], segs: Vec<String>| -> Option<(Vec<String>, bool)> {
        let first = segs.first()?.as_str();
        match first {
            "crate" => Some((segs[1..].to_vec(), true)),
            "super" | "self" => {
                let mut m = scope.to_vec();
                let mut rest = &segs[..];
                while let Some(s) = rest.first() {
                    match s.as_str() {
                        "super" => {
                            m.pop();
                        }
                        "self" => {}
                        _ => break,
                    }
                    rest = &rest[1..];
                }
                m.extend(rest.iter().cloned());
                Some((m, true))
            }
            _ => {
                // A child module named without `self::` (2018 paths), else an external crate.
                let mut child = scope.to_vec();
                child.push(first.to_string());
                if !source.in_bin && resolve(src_dir, &child).is_some_and(|(_, m)| m == child) {
                    let mut m = scope.to_vec();
                    m.extend(segs.iter().cloned());
                    Some((m, true))
                } else {
                    Some((segs, false))
                }
            }
        }
    };
    let named = |scope: &[String], segs: Vec<String>, line: usize| {
        let in_test = scope.iter().any(|m| m == "tests");
        absolute(scope, segs).map(|(segs, local)| Named {
            segs,
            local,
            in_test,
            line,
        })
    };
    while i < b.len() {
        let c = b[i];
        if c == b'{' {
            depth += 1;
            i += 1;
            continue;
        }
        if c == b'}' {
            depth = depth.saturating_sub(1);
            while inline.last().is_some_and(|(_, d)| *d > depth) {
                inline.pop();
            }
            i += 1;
            continue;
        }
        if !is_ident(c) || ident_before(b, i) {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() && is_ident(b[j]) {
            j += 1;
        }
        let word = &text[i..j];
        if word == "mod" {
            // `mod name {` opens an inline module; `mod name;` declares a file.
            let rest = &text[j..];
            let name_len = rest
                .trim_start()
                .bytes()
                .take_while(|&x| is_ident(x))
                .count();
            let name_start = j + (rest.len() - rest.trim_start().len());
            let after = text[name_start + name_len..].trim_start();
            if name_len > 0 && after.starts_with('{') {
                inline.push((
                    text[name_start..name_start + name_len].to_string(),
                    depth + 1,
                ));
            }
            i = j;
            continue;
        }
        if word == "use" {
            let end = text[j..].find(';').map_or(b.len(), |k| j + k);
            let line = line_of(text, i);
            let here = scope(&inline);
            for segs in expand_use(&text[j..end]) {
                found.extend(named(&here, segs, line));
            }
            i = end;
            continue;
        }
        // An inline path: word::word::...
        let mut segs = vec![word.to_string()];
        let mut k = j;
        loop {
            let rest = &text[k..];
            let trimmed = rest.trim_start();
            if !trimmed.starts_with("::") {
                break;
            }
            let after = trimmed[2..].trim_start();
            let start = k + (rest.len() - after.len());
            let len = after.bytes().take_while(|&x| is_ident(x)).count();
            if len == 0 {
                break;
            }
            segs.push(text[start..start + len].to_string());
            k = start + len;
        }
        if segs.len() > 1 {
            found.extend(named(&scope(&inline), segs, line_of(text, i)));
        }
        i = k;
    }
    found
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
        let Ok(in_src) = path.strip_prefix(&src_dir) else {
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
    // (folder module, child a, child b) -> where a imports b.
    let mut edges: BTreeMap<(Vec<String>, String, String), (PathBuf, usize)> = BTreeMap::new();
    for s in &sources {
        let mine = if s.in_bin { None } else { part_of(&s.module) };
        let pure = mine.is_some_and(|p| PURE_PARTS.iter().any(|x| LAYERS[p] == *x));
        for named in named_paths(&src_dir, s) {
            let full = named.segs.join("::");
            if pure {
                let shown = if named.local {
                    format!("crate::{full}")
                } else {
                    full.clone()
                };
                if let Some(bad) = IMPURE
                    .iter()
                    .find(|x| shown == **x || shown.starts_with(&format!("{x}::")))
                {
                    findings.push(Finding {
                        file: s.rel.clone(),
                        line: named.line,
                        what: format!(
                            "`{shown}`: {} may not use `{bad}` (plan and engine are pure: \
                             events and time in, commands out; the runtime does the I/O)",
                            LAYERS[mine.unwrap_or(0)]
                        ),
                    });
                }
            }
            if !named.local || s.in_bin {
                continue;
            }
            let in_model = MODEL_CODE.iter().any(|m| s.module.join("::") == *m);
            let kernel = KERNEL_MODULES
                .iter()
                .find(|k| full.starts_with(&format!("{k}::")));
            let helper = named
                .segs
                .last()
                .is_some_and(|l| KERNEL_HELPERS.contains(&l.as_str()));
            if let (true, false, Some(k), false) = (in_model, named.in_test, kernel, helper) {
                findings.push(Finding {
                    file: s.rel.clone(),
                    line: named.line,
                    what: format!(
                        "`{full}`: {} computes through its backend (`model::backend`), not \
                         `{k}` directly, so a device backend runs all of it",
                        s.module.join("::")
                    ),
                });
            }
            let Some((_, target)) = resolve(&src_dir, &named.segs) else {
                continue;
            };
            // A parent naming its own children (declaring, re-exporting) is not layering.
            if target.starts_with(&s.module) {
                continue;
            }
            if let (Some(mine), Some(theirs)) = (mine, part_of(&target)) {
                if theirs > mine {
                    findings.push(Finding {
                        file: s.rel.clone(),
                        line: named.line,
                        what: format!(
                            "`{}` imports `{full}`, but {} sits above {} in the declared order \
                             (LAYERS in tests/tidy.rs; README \"Layout\"): move the shared item down",
                            s.module.join("::"),
                            LAYERS[theirs],
                            LAYERS[mine]
                        ),
                    });
                }
            }
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

/// Where `LAYERS` and the tree or the README's "Layout" table disagree: a part that is not a
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
                         imports put it, and a row to the README's Layout table"
                    ),
                ));
            }
        }
    }
    let readme = fs::read_to_string(root.join("README.md")).unwrap_or_default();
    let start = readme.find("## Layout").unwrap_or(readme.len());
    let end = readme[start..]
        .find("\n## ")
        .map_or(readme.len(), |k| start + k + 1);
    let section = &readme[start..end];
    let section_line = line_of(&readme, start);
    let mut last = 0;
    for (layer, shown) in rows {
        match section.find(&format!("`{shown}`")) {
            Some(at) if at >= last => last = at,
            Some(at) => findings.push(finding(
                "README.md",
                section_line + line_of(section, at) - 1,
                format!("the Layout table lists `{shown}` ({layer}) before a part below it; keep LAYERS' order"),
            )),
            None => findings.push(finding(
                "README.md",
                section_line,
                format!("the Layout table has no row for `{shown}` ({layer})"),
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
