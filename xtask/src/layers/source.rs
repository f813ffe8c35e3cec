//! Reads one Rust source file as far as the layer check needs: the `mod NAME;` it declares,
//! the paths into its own crate it names (`crate::`, `super::`, `self::`, in `use` trees and in
//! code), what it re-exports, and its public functions that return `Result<_, String>`.

/// A path into the crate, made absolute, with the line it was written on.
#[derive(Debug, Clone)]
pub struct Reference {
    pub path: Vec<String>,
    pub line: usize,
}

/// What one file says.
#[derive(Debug, Default)]
pub struct Source {
    /// `mod NAME;` declarations (files of their own), with inline `mod NAME { .. }` left out.
    pub modules: Vec<(String, bool)>,
    pub references: Vec<Reference>,
    /// `pub use PATH::NAME [as ALIAS]`: ALIAS (or NAME) names PATH::NAME.
    pub reexports: Vec<(String, Vec<String>)>,
    /// Lines of public functions returning `Result<_, String>`.
    pub string_errors: Vec<usize>,
    /// Methods in `impl TYPE { .. }` blocks (not trait impls), by type.
    pub inherent_methods: Vec<(String, usize)>,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Punct(&'static str),
}

/// Identifiers and the few punctuation marks paths are made of; comments, strings and
/// character literals are dropped. Each token carries its line.
fn tokens(text: &str) -> Vec<(Token, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'\n' => {
                line += 1;
                i += 1;
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < bytes.len() {
                    if bytes[i..].starts_with(b"/*") {
                        depth += 1;
                        i += 2;
                    } else if bytes[i..].starts_with(b"*/") {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        line += usize::from(bytes[i] == b'\n');
                        i += 1;
                    }
                }
            }
            b'r' | b'b' if raw_string_start(&bytes[i..]).is_some() => {
                let (skip, hashes) = raw_string_start(&bytes[i..]).unwrap_or_default();
                i += skip;
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                while i < bytes.len() && !bytes[i..].starts_with(&close) {
                    line += usize::from(bytes[i] == b'\n');
                    i += 1;
                }
                i += close.len();
            }
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    line += usize::from(bytes.get(i) == Some(&b'\n'));
                    i += 1;
                }
                i += 1;
            }
            b'\'' => i += char_literal_len(&bytes[i..]),
            b':' if bytes.get(i + 1) == Some(&b':') => {
                out.push((Token::Punct("::"), line));
                i += 2;
            }
            b'-' if bytes.get(i + 1) == Some(&b'>') => {
                out.push((Token::Punct("->"), line));
                i += 2;
            }
            _ if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                let word = &text[start..i];
                out.push((Token::Ident(word.to_string()), line));
            }
            _ => {
                const MARKS: &[&str] = &["{", "}", "(", ")", "<", ">", ",", ";", "*", "#", "["];
                if let Some(mark) = MARKS.iter().find(|m| m.as_bytes()[0] == c) {
                    out.push((Token::Punct(mark), line));
                }
                i += 1;
            }
        }
    }
    out
}

/// `r"`, `r#"`, `br"` ...: how many bytes open a raw string and how many `#` close it.
fn raw_string_start(b: &[u8]) -> Option<(usize, usize)> {
    let i = if b.starts_with(b"br") {
        2
    } else if b.starts_with(b"r") {
        1
    } else {
        return None;
    };
    let hashes = b[i..].iter().take_while(|&&c| c == b'#').count();
    (b.get(i + hashes) == Some(&b'"')).then_some((i + hashes + 1, hashes))
}

/// A character literal's length, or 1 for a lifetime's quote.
fn char_literal_len(b: &[u8]) -> usize {
    match b.get(1) {
        Some(b'\\') => b
            .iter()
            .skip(2)
            .position(|&c| c == b'\'')
            .map_or(1, |p| p + 3),
        Some(_) if b.get(2) == Some(&b'\'') => 3,
        Some(&c) if c >= 0x80 => b
            .iter()
            .skip(1)
            .take(5)
            .position(|&c| c == b'\'')
            .map_or(1, |p| p + 2),
        _ => 1,
    }
}

/// Reads a file whose module path is `module` (`is_dir_root` for `lib.rs`, `main.rs`, `mod.rs`).
pub fn read(text: &str, module: &[String]) -> Source {
    let toks = tokens(text);
    let mut source = Source::default();
    // Modules this file declares: a path may start with one (`use store::Store;` in `lib.rs`).
    let children: Vec<String> = toks
        .windows(2)
        .filter_map(|w| match w {
            [(Token::Ident(m), _), (Token::Ident(name), _)] if m == "mod" => Some(name.clone()),
            _ => None,
        })
        .collect();
    // The module each open brace belongs to: inline `mod NAME {` shifts `self` and `super`.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    // Open `impl TYPE {` blocks: the type and the depth inside them.
    let mut impls: Vec<(String, usize)> = Vec::new();
    let mut i = 0;
    let ident = |k: usize| match toks.get(k) {
        Some((Token::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let punct = |k: usize, p: &str| matches!(toks.get(k), Some((Token::Punct(q), _)) if *q == p);
    while i < toks.len() {
        let here: Vec<String> = module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(m, _)| m.clone()))
            .collect();
        let line = toks[i].1;
        if is_cfg_test(&toks, i) {
            // Test code may reach any layer: it is not built into the crate.
            i = end_of_item(&toks, i + 6);
            continue;
        }
        if punct(i, "{") {
            depth += 1;
        } else if punct(i, "}") {
            if impls.last().is_some_and(|(_, d)| *d == depth) {
                impls.pop();
            }
            depth = depth.saturating_sub(1);
            if inline.last().is_some_and(|(_, d)| *d == depth) {
                inline.pop();
            }
        } else if ident(i) == Some("mod")
            && let Some(name) = ident(i + 1)
        {
            if punct(i + 2, ";") && inline.is_empty() {
                let public =
                    ident(i.wrapping_sub(1)) == Some("pub") || punct(i.wrapping_sub(1), ")");
                source.modules.push((name.to_string(), public));
            } else if punct(i + 2, "{") {
                inline.push((name.to_string(), depth));
                depth += 1;
                i += 3;
                continue;
            }
        } else if ident(i) == Some("use") {
            let public = ident(i.wrapping_sub(1)) == Some("pub") || punct(i.wrapping_sub(1), ")");
            let mut k = i + 1;
            let mut leaves = Vec::new();
            use_tree(&toks, &mut k, Vec::new(), &mut leaves);
            for (path, alias) in leaves {
                if let Some(absolute) = absolute(&path, &here, &children) {
                    if public && let Some(alias) = alias.or_else(|| path.last().cloned()) {
                        source.reexports.push((alias, absolute.clone()));
                    }
                    source.references.push(Reference {
                        path: absolute,
                        line,
                    });
                }
            }
            i = k;
            continue;
        } else if let Some(first) = ident(i)
            .filter(|w| matches!(*w, "crate" | "super" | "self") || children.iter().any(|c| c == w))
            && punct(i + 1, "::")
            && !(i > 0 && punct(i - 1, "::"))
        {
            let mut path = vec![first.to_string()];
            let mut k = i + 1;
            while punct(k, "::")
                && let Some(seg) = ident(k + 1)
            {
                path.push(seg.to_string());
                k += 2;
            }
            if let Some(absolute) = absolute(&path, &here, &children) {
                source.references.push(Reference {
                    path: absolute,
                    line,
                });
            }
            i = k;
            continue;
        } else if ident(i) == Some("impl")
            && let Some(name) = ident(i + 1)
            && punct(i + 2, "{")
        {
            impls.push((name.to_string(), depth + 1));
            source.inherent_methods.push((name.to_string(), 0));
        } else if ident(i) == Some("fn") {
            if impls.last().is_some_and(|(_, d)| *d == depth)
                && let Some((_, count)) = source.inherent_methods.last_mut()
            {
                *count += 1;
            }
            if is_public_fn(&toks, i) && returns_string_error(&toks, i) {
                source.string_errors.push(line);
            }
        }
        i += 1;
    }
    source
}

/// Whether `#[cfg(test)]` starts at `at`.
fn is_cfg_test(toks: &[(Token, usize)], at: usize) -> bool {
    let want = [
        Token::Punct("#"),
        Token::Punct("["),
        Token::Ident("cfg".into()),
        Token::Punct("("),
        Token::Ident("test".into()),
        Token::Punct(")"),
    ];
    toks.len() >= at + want.len()
        && toks[at..at + want.len()]
            .iter()
            .map(|t| &t.0)
            .eq(want.iter())
}

/// The token after the item that starts at `at`: its `;`, or the `}` closing its first block.
fn end_of_item(toks: &[(Token, usize)], at: usize) -> usize {
    let mut k = at;
    while k < toks.len() {
        match toks[k].0 {
            Token::Punct(";") => return k + 1,
            Token::Punct("{") => {
                let mut depth = 0;
                while k < toks.len() {
                    match toks[k].0 {
                        Token::Punct("{") => depth += 1,
                        Token::Punct("}") => {
                            depth -= 1;
                            if depth == 0 {
                                return k + 1;
                            }
                        }
                        _ => {}
                    }
                    k += 1;
                }
            }
            _ => k += 1,
        }
    }
    k
}

/// Walks a `use` tree from `k` to its `;`, collecting each leaf's full path and alias.
fn use_tree(
    toks: &[(Token, usize)],
    k: &mut usize,
    prefix: Vec<String>,
    leaves: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut path = prefix;
    loop {
        match toks.get(*k).map(|t| &t.0) {
            Some(Token::Ident(word)) if word == "as" => {
                let alias = match toks.get(*k + 1).map(|t| &t.0) {
                    Some(Token::Ident(a)) => Some(a.clone()),
                    _ => None,
                };
                leaves.push((path.clone(), alias));
                *k += 2;
                return;
            }
            Some(Token::Ident(word)) => {
                path.push(word.clone());
                *k += 1;
            }
            Some(Token::Punct("::")) => *k += 1,
            Some(Token::Punct("*")) => {
                leaves.push((path.clone(), None));
                *k += 1;
                return;
            }
            Some(Token::Punct("{")) => {
                *k += 1;
                while !matches!(toks.get(*k).map(|t| &t.0), None | Some(Token::Punct("}"))) {
                    use_tree(toks, k, path.clone(), leaves);
                    if matches!(toks.get(*k).map(|t| &t.0), Some(Token::Punct(","))) {
                        *k += 1;
                    }
                }
                *k += 1;
                return;
            }
            _ => {
                if path.last().is_some_and(|s| s == "self") {
                    path.pop();
                }
                if !path.is_empty() {
                    leaves.push((path, None));
                }
                return;
            }
        }
    }
}

/// `crate::a::b`, `super::b`, `self::b` or `child::b` made absolute from the module `here`;
/// `None` for a path into another crate.
fn absolute(path: &[String], here: &[String], children: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = here.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some(first) if children.iter().any(|c| c == first) => {}
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// Whether the `fn` at `at` is `pub` or `pub(..)`, past `async`, `const`, `unsafe`.
fn is_public_fn(toks: &[(Token, usize)], at: usize) -> bool {
    let mut k = at;
    while k > 0
        && matches!(&toks[k - 1].0, Token::Ident(w) if matches!(w.as_str(), "async" | "const" | "unsafe"))
    {
        k -= 1;
    }
    match toks.get(k.wrapping_sub(1)).map(|t| &t.0) {
        Some(Token::Ident(w)) => w == "pub",
        Some(Token::Punct(")")) => {
            let open = toks[..k].iter().rposition(|t| t.0 == Token::Punct("("));
            open.is_some_and(|o| matches!(toks.get(o.wrapping_sub(1)).map(|t| &t.0), Some(Token::Ident(w)) if w == "pub"))
        }
        _ => false,
    }
}

/// Whether the `fn` at `at` declares `-> Result<.., String>` before its body.
fn returns_string_error(toks: &[(Token, usize)], at: usize) -> bool {
    let Some(arrow) = (at..toks.len())
        .take_while(|&k| !matches!(toks[k].0, Token::Punct("{") | Token::Punct(";")))
        .find(|&k| toks[k].0 == Token::Punct("->"))
    else {
        return false;
    };
    let ret: Vec<&Token> = toks[arrow + 1..]
        .iter()
        .map(|t| &t.0)
        .take_while(|t| !matches!(t, Token::Punct("{") | Token::Punct(";")))
        .collect();
    let is = |t: &Token, w: &str| matches!(t, Token::Ident(s) if s == w);
    ret.first().is_some_and(|t| is(t, "Result"))
        && ret.len() >= 3
        && is(ret[ret.len() - 2], "String")
        && ret[ret.len() - 1] == &Token::Punct(">")
        && ret[ret.len() - 3] == &Token::Punct(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(text: &str, here: &[&str]) -> Vec<String> {
        let here: Vec<String> = here.iter().map(|s| s.to_string()).collect();
        read(text, &here)
            .references
            .into_iter()
            .map(|r| format!("{}@{}", r.path.join("::"), r.line))
            .collect()
    }

    #[test]
    fn use_trees_code_paths_and_inline_modules_resolve() {
        let text = "use crate::{store::{Store, rules::self}, runs::*};\n\
                    // crate::comment::Ignored\n\
                    fn f() { let s = \"crate::string::Ignored\"; super::peer::dial(); }\n\
                    mod inner { use super::*; use super::super::x::Y; }\n\
                    #[cfg(test)]\nmod tests { use crate::test_only::X; }\n";
        assert_eq!(
            paths(text, &["serve", "first"]),
            vec![
                "store::Store@1",
                "store::rules@1",
                "runs@1",
                "serve::peer::dial@3",
                "serve::first@4",
                "serve::x::Y@4"
            ]
        );
    }

    #[test]
    fn public_functions_returning_string_errors_are_found() {
        let text = "pub fn a() -> Result<(), String> { }\nfn b() -> Result<(), String> {}\n\
                    pub fn c(x: u8) -> Result<Vec<u8>, Error> {}\npub fn d() -> Result<u8, String>;\n";
        assert_eq!(read(text, &[]).string_errors, vec![1, 4]);
    }

    #[test]
    fn module_declarations_and_reexports_are_read() {
        let text = "#[cfg(test)]\nmod tests;\nmod x_tests;\npub mod store;\npub(crate) mod x;\nmod inline { mod inner; }\n\
                    pub use self::store::{Store as S, Rules};\nuse lifetimes::<'a>::X;\nconst C: char = '{';";
        let source = read(text, &[]);
        assert_eq!(
            source.modules,
            vec![
                ("x_tests".into(), false),
                ("store".into(), true),
                ("x".into(), true)
            ]
        );
        let names: Vec<_> = source
            .reexports
            .iter()
            .map(|(a, p)| format!("{a}={}", p.join("::")))
            .collect();
        assert_eq!(names, vec!["S=store::Store", "Rules=store::Rules"]);
    }
}
