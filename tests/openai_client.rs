//! Runs the official `openai` Python client against `tandem serve` (tests/serve/openai_client.py):
//! completion, chat, streaming, greedy equality with `tandem generate`, a 4xx, and SIGTERM.
//! `scripts/test.sh` installs the pinned client.

use std::process::Command;

#[test]
fn openai_python_client_against_tandem_serve() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .arg("tests/serve/openai_client.py")
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .current_dir(root)
        .output()
        .expect("python3 runs");
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "openai client test failed:\n{log}");
    assert!(log.contains("openai client test: ok"), "{log}");
}
