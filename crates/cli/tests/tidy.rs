//! House-style checks that run as tests (TigerBeetle's tidy): every Rust file opens with a `//!`
//! comment saying what it is for, and no debugging leftovers reach main.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

fn workspace_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("fuzz/fuzz_targets"), &mut files);
    assert!(
        files.len() > 20,
        "found only {} files under {}",
        files.len(),
        root.display()
    );
    files
}

#[test]
fn every_file_opens_with_a_doc_comment() {
    let missing: Vec<String> = workspace_files()
        .into_iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            !text.trim_start().starts_with("//!")
        })
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "files without a //! opening comment: {missing:#?}"
    );
}

#[test]
fn no_debugging_leftovers() {
    // Spelled in two halves so that this file does not trip its own check.
    let banned = [
        ["dbg", "!("],
        ["todo", "!("],
        ["FIX", "ME"],
        ["XX", "X "],
        ["unimplemented", "!("],
    ];
    let mut found = Vec::new();
    for p in workspace_files() {
        let text = std::fs::read_to_string(&p).unwrap();
        for (n, line) in text.lines().enumerate() {
            for [a, b] in banned {
                if line.contains(&format!("{a}{b}")) {
                    found.push(format!("{}:{}: {}", p.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "debugging leftovers: {found:#?}");
}
