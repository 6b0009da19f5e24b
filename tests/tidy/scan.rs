//! Reading Rust source for `tidy.rs`: blanking comments and literals, expanding `use` trees,
//! and finding every path a file names (in `use` items and inline), resolved to the crate's
//! own modules where it starts there.

use std::path::{Path, PathBuf};

/// One path a file names: its segments, made absolute where it is the crate's own.
#[derive(Debug, Clone)]
pub(super) struct Named {
    pub(super) segs: Vec<String>,
    /// Starts at this crate's root (`crate::`, `super::`, `self::` or a child module).
    pub(super) local: bool,
    /// Named from test code (a `tests` module), which may reach across siblings.
    pub(super) in_test: bool,
    pub(super) line: usize,
}

/// Source text with comments, string and char literals blanked (newlines kept, so offsets
/// still give line numbers).
pub(super) fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        i = if c == b'/' && next == Some(b'/') {
            line_comment(b, i, &mut out)
        } else if c == b'/' && next == Some(b'*') {
            block_comment(b, i, &mut out)
        } else if c == b'r' && matches!(next, Some(b'"') | Some(b'#')) && !ident_before(b, i) {
            raw_string(b, i, &mut out)
        } else if c == b'"' {
            string(b, i, &mut out)
        } else if c == b'\'' {
            char_or_lifetime(b, i, &mut out)
        } else {
            out.push(c);
            i + 1
        };
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Blanks `c`, keeping a newline.
fn blank(out: &mut Vec<u8>, c: u8) {
    out.push(if c == b'\n' { b'\n' } else { b' ' });
}

/// Blanks the `//` comment at `i` up to its newline; returns where the newline is.
fn line_comment(b: &[u8], mut i: usize, out: &mut Vec<u8>) -> usize {
    while i < b.len() && b[i] != b'\n' {
        out.push(b' ');
        i += 1;
    }
    i
}

/// Blanks the `/* */` comment at `i`, nested ones included; returns the index past it.
fn block_comment(b: &[u8], mut i: usize, out: &mut Vec<u8>) -> usize {
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
            blank(out, b[i]);
            i += 1;
        }
    }
    i
}

/// Blanks the raw string (`r"..."` or `r#"..."#`) at `i`; keeps the `r` when no quote follows
/// its hashes. Returns the index past what it read.
fn raw_string(b: &[u8], i: usize, out: &mut Vec<u8>) -> usize {
    let mut j = i + 1;
    while b.get(j) == Some(&b'#') {
        j += 1;
    }
    if b.get(j) != Some(&b'"') {
        out.push(b[i]);
        return i + 1;
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
        blank(out, x);
    }
    k
}

/// Blanks the string literal at `i`, escapes included; returns the index past its closing quote.
fn string(b: &[u8], mut i: usize, out: &mut Vec<u8>) -> usize {
    out.push(b' ');
    i += 1;
    while i < b.len() && b[i] != b'"' {
        if b[i] == b'\\' {
            blank(out, b[i]);
            i += 1;
        }
        if i < b.len() {
            blank(out, b[i]);
            i += 1;
        }
    }
    out.push(b' ');
    i + 1
}

/// A char literal ('x', '\n', '\u{..}') at `i` is blanked; a lifetime ('a) is kept. Returns
/// the index past what it read.
fn char_or_lifetime(b: &[u8], i: usize, out: &mut Vec<u8>) -> usize {
    if b.get(i + 1) == Some(&b'\\') {
        let mut k = i + 2;
        while k < b.len() && b[k] != b'\'' {
            k += 1;
        }
        for &x in &b[i..=k.min(b.len() - 1)] {
            blank(out, x);
        }
        k + 1
    } else if b.get(i + 2) == Some(&b'\'') || multibyte_char(b, i) {
        let len = char_len(b, i + 1);
        out.extend(std::iter::repeat_n(b' ', len + 2));
        i + len + 2
    } else {
        out.push(b[i]);
        i + 1
    }
}

pub(super) fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

pub(super) fn char_len(b: &[u8], i: usize) -> usize {
    match b.get(i) {
        Some(&x) if x >= 0xF0 => 4,
        Some(&x) if x >= 0xE0 => 3,
        Some(&x) if x >= 0xC0 => 2,
        _ => 1,
    }
}

pub(super) fn multibyte_char(b: &[u8], i: usize) -> bool {
    let len = char_len(b, i + 1);
    len > 1 && b.get(i + 1 + len) == Some(&b'\'')
}

pub(super) fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].bytes().filter(|&c| c == b'\n').count() + 1
}

/// Expands a `use` tree (`a::{b, c::{d, e as f}, self}`) into its paths.
pub(super) fn expand_use(tree: &str) -> Vec<Vec<String>> {
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

pub(super) fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// A source file of the library (or of the binary's `cli`), with its module path.
pub(super) struct Source {
    pub(super) rel: PathBuf,
    pub(super) module: Vec<String>,
    /// `crate::` in this file means the binary, whose modules all sit above the library.
    pub(super) in_bin: bool,
    pub(super) text: String,
}

/// The module path of a file under `src/` (`runtime/step/comm.rs` -> runtime::step::comm).
pub(super) fn module_of(rel_to_src: &Path) -> Vec<String> {
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
pub(super) fn resolve(src: &Path, segs: &[String]) -> Option<(PathBuf, Vec<String>)> {
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
pub(super) fn named_paths(src_dir: &Path, source: &Source) -> Vec<Named> {
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
    let named = |scope: &[String], segs: Vec<String>, line: usize| {
        let in_test = scope.iter().any(|m| m == "tests");
        absolute(src_dir, source, scope, segs).map(|(segs, local)| Named {
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
            if let Some(name) = inline_module(text, j) {
                inline.push((name, depth + 1));
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
        let (segs, k) = inline_path(text, word, j);
        if segs.len() > 1 {
            found.extend(named(&scope(&inline), segs, line_of(text, i)));
        }
        i = k;
    }
    found
}

/// `segs` named in module `scope`, made absolute when it starts at the crate's own modules;
/// with whether it does.
fn absolute(
    src_dir: &Path,
    source: &Source,
    scope: &[String],
    segs: Vec<String>,
) -> Option<(Vec<String>, bool)> {
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
}

/// The name of the inline module whose `mod` keyword ends at `j` (`mod name {`); `None` for
/// `mod name;`, which declares a file.
fn inline_module(text: &str, j: usize) -> Option<String> {
    let rest = &text[j..];
    let name_len = rest
        .trim_start()
        .bytes()
        .take_while(|&x| is_ident(x))
        .count();
    let name_start = j + (rest.len() - rest.trim_start().len());
    let after = text[name_start + name_len..].trim_start();
    (name_len > 0 && after.starts_with('{'))
        .then(|| text[name_start..name_start + name_len].to_string())
}

/// The inline path `word::word::...` whose first word ends at `j`: its segments and the index
/// past its last.
fn inline_path(text: &str, word: &str, j: usize) -> (Vec<String>, usize) {
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
    (segs, k)
}
