//! The policy's modules import one another in no circle: each answers one question and
//! leans only on the ones below it (docs/CONTROLLER.md), so a module can be read, and
//! tested, from the bottom up. Read from the source files (core/src/policy/*.rs, the code
//! before a file's `#[cfg(test)]`), as `super::NAME` and `crate::policy::NAME` paths whose
//! first segment is a sibling module. `cargo test --test policy_imports -- --nocapture`
//! prints the graph.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The modules under core/src/policy (files, less mod.rs) and what each one's non-test
/// code names of its siblings.
fn policy_graph() -> Graph {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/policy");
    let mut sources = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).expect("core/src/policy") {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.extension().is_some_and(|e| e == "rs") && stem != "mod" {
            sources.insert(stem, std::fs::read_to_string(&path).unwrap());
        }
    }
    let names: BTreeSet<String> = sources.keys().cloned().collect();
    sources
        .iter()
        .map(|(module, text)| {
            let used = siblings_named(&production_code(text))
                .into_iter()
                .filter(|n| names.contains(n) && n != module)
                .collect();
            (module.clone(), used)
        })
        .collect()
}

/// The code before the first `#[cfg(test)]`, line comments (doc comments too) taken out.
fn production_code(text: &str) -> String {
    text.lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first segment of every path after `super::` or `crate::policy::`, through `{…}`
/// groups (`use super::{a::X, b};` names a and b).
fn siblings_named(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for prefix in ["super::", "crate::policy::"] {
        let mut rest = code;
        while let Some(i) = rest.find(prefix) {
            rest = &rest[i + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let mut depth = 1;
                let end = group
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .map_or(group.len(), |(k, _)| k);
                let mut depth = 0;
                let mut start = 0;
                for (k, c) in group[..end].char_indices().chain([(end, ',')]) {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            out.insert(first_segment(&group[start..k]));
                            start = k + 1;
                        }
                        _ => {}
                    }
                }
            } else {
                out.insert(first_segment(rest));
            }
        }
    }
    out
}

fn first_segment(path: &str) -> String {
    path.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// One circle of imports, as the modules along it (the first repeated at the end), if
/// there is any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_policy_modules_import_one_another_in_no_circle() {
    let graph = policy_graph();
    for (module, used) in &graph {
        let used: Vec<&str> = used.iter().map(String::as_str).collect();
        println!("{module} -> {}", used.join(", "));
    }
    assert!(graph.len() > 1, "no modules read under core/src/policy");
    assert!(
        graph.values().any(|u| !u.is_empty()),
        "no imports found: the reader no longer matches the source"
    );
    assert_eq!(find_cycle(&graph), None, "a circle of imports: {graph:#?}");
}

#[test]
fn the_reader_finds_grouped_imports_and_the_circles_they_make() {
    let code = production_code(
        "use super::a::X;\nuse super::{b::{Y, Z}, c};\n// use super::d;\nfn f() { crate::policy::e::g() }\n#[cfg(test)]\nuse super::h;",
    );
    let named: Vec<String> = siblings_named(&code).into_iter().collect();
    assert_eq!(named, ["a", "b", "c", "e"]);
    let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
        .iter()
        .map(|(f, t)| (f.to_string(), BTreeSet::from([t.to_string()])))
        .collect();
    assert_eq!(
        find_cycle(&graph),
        Some(["a", "b", "c", "a"].map(String::from).to_vec())
    );
    let mut acyclic = graph.clone();
    acyclic.remove("c");
    assert_eq!(find_cycle(&acyclic), None);
}
