//! Function length: a hand-written function is at most `FN_LINES_MAX` lines from its `fn` line
//! to its closing brace, so it can be read at once. A longer one is split along its concepts
//! (one function per message family, per phase of a step), not into numbered pieces.
//!
//! It reads the stripped text (`scan::strip`: no comments or literals), so braces in strings do
//! not count. A `fn` whose signature ends in `;` (a trait method declaration, an `extern` item)
//! has no body and is skipped; a `fn` written inside another is measured on its own and within
//! the outer one; `fn(..)` pointer types and `fn $name` in macro patterns are not functions.

use super::*;

pub(super) const FN_LINES_MAX: usize = 100;

/// One function body: where its `fn` is, its name, and its length in lines.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FnSpan {
    line: usize,
    name: String,
    lines: usize,
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Every function with a body in `text` (already stripped), in source order.
fn functions(text: &str) -> Vec<FnSpan> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(k) = text[i..].find("fn") {
        let at = i + k;
        i = at + 2;
        let keyword =
            (at == 0 || !is_ident(b[at - 1])) && b.get(at + 2).is_some_and(|c| !is_ident(*c));
        if !keyword {
            continue;
        }
        let mut j = at + 2;
        while b.get(j).is_some_and(|c| c.is_ascii_whitespace()) {
            j += 1;
        }
        let name_start = j;
        while b.get(j).is_some_and(|c| is_ident(*c)) {
            j += 1;
        }
        // `fn(u8) -> u8` (a pointer type) or `fn $name` (a macro pattern): no function here.
        if j == name_start || b[name_start].is_ascii_digit() {
            continue;
        }
        let Some(open) = body_start(b, j) else {
            continue;
        };
        let Some(close) = matching_brace(b, open) else {
            continue;
        };
        let first = line_of(text, at);
        out.push(FnSpan {
            line: first,
            name: text[name_start..j].to_string(),
            lines: line_of(text, close) - first + 1,
        });
    }
    out
}

/// The `{` opening the body of a function whose signature starts at `from`, or `None` when
/// the signature ends in `;` first. Brackets and parentheses are skipped, so `[u8; 4]` in a
/// parameter does not end it; a `where` clause holds neither `{` nor `;` at depth 0.
fn body_start(b: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, c) in b.iter().enumerate().skip(from) {
        match c {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth = depth.saturating_sub(1),
            b'{' if depth == 0 => return Some(k),
            b';' if depth == 0 => return None,
            _ => {}
        }
    }
    None
}

/// The `}` closing the `{` at `open`.
fn matching_brace(b: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, c) in b.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// Every hand-written function under `root`'s source folders longer than `FN_LINES_MAX`.
pub(super) fn long_functions(root: &Path) -> Vec<Finding> {
    let mut all = Vec::new();
    for d in SOURCE_DIRS {
        rust_files(&root.join(d), &mut all);
    }
    let mut findings = Vec::new();
    for path in &all {
        let raw = fs::read_to_string(path).unwrap_or_default();
        if raw.lines().take(3).any(|l| l.contains(GENERATED_MARKER)) {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap_or(path).to_path_buf();
        for f in functions(&strip(&raw)) {
            if f.lines > FN_LINES_MAX {
                findings.push(Finding {
                    file: rel.clone(),
                    line: f.line,
                    what: format!(
                        "`{}` is {} lines, over {FN_LINES_MAX}: split it along its concepts",
                        f.name, f.lines
                    ),
                });
            }
        }
    }
    findings.sort();
    findings
}

/// Planted trees: the rule bites on one line too many and passes what it should.
mod planted {
    use super::*;

    /// A function `fn name` of exactly `lines` lines, its body `let`s.
    fn function(name: &str, lines: usize) -> String {
        let mut s = format!("pub fn {name}() {{\n");
        for k in 0..lines - 2 {
            s.push_str(&format!("    let _x{k} = \"}}\";\n"));
        }
        s.push_str("}\n");
        s
    }

    fn found(files: &[(&str, &str)]) -> Vec<String> {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let p = dir.path().join(path);
            fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            fs::write(p, text).expect("write");
        }
        long_functions(dir.path())
            .iter()
            .map(|f| f.to_string())
            .collect()
    }

    #[test]
    fn a_function_of_101_lines_is_refused() {
        let text = format!("//! x\n\n{}", function("long", FN_LINES_MAX + 1));
        let found = found(&[("src/plan/mod.rs", &text)]);
        assert_eq!(
            found,
            ["src/plan/mod.rs:3: `long` is 101 lines, over 100: split it along its concepts"],
        );
    }

    #[test]
    fn a_function_of_100_lines_passes() {
        let text = function("just_short", FN_LINES_MAX);
        assert!(found(&[("src/plan/mod.rs", &text)]).is_empty());
    }

    #[test]
    fn a_long_generated_file_passes() {
        let text = format!("// @generated by bindgen\n{}", function("long", 300));
        assert!(found(&[("src/sys.rs", &text)]).is_empty());
    }

    #[test]
    fn trait_declarations_are_not_bodies() {
        // Multi-line declarations ending in `;` and a `where` clause must not swallow the
        // default method after them; the default method alone is measured.
        let text = format!(
            "pub trait T {{\n    fn a(\n        &self,\n        x: [u8; 4],\n    ) -> u8;\n    \
             fn b<F>(&self, f: F) -> u8\n    where\n        F: Fn(u8) -> u8;\n{}}}\n",
            function("c", FN_LINES_MAX + 1)
        );
        let found = found(&[("src/plan/mod.rs", &text)]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("src/plan/mod.rs:9: `c` is 101 lines"),
            "{found:?}"
        );
    }

    #[test]
    fn nested_functions_closures_and_pointer_types_are_measured_by_their_braces() {
        let text = "impl S {\n    fn outer(&self, g: fn(u8) -> u8) -> u8 {\n        fn inner() {}\n        \
                    let h = |x: u8| { x };\n        macro_rules! m { (fn $n:ident) => {} }\n        \
                    g(h(1))\n    }\n}\n";
        let spans = functions(&strip(text));
        let got: Vec<_> = spans
            .iter()
            .map(|f| (f.name.as_str(), f.line, f.lines))
            .collect();
        assert_eq!(got, [("outer", 2, 6), ("inner", 3, 1)]);
    }
}
