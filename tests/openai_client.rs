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

/// `tandem serve` refuses to start when the head was trained for another chat template (its
/// manifest's fingerprint differs from the served target's), with the check's sentence, and
/// starts anyway with the experiments-only override.
#[test]
fn serve_refuses_a_head_wired_for_another_template() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let head = root.join("heads/smollm2-135m-eagle3");
    let dir = std::env::temp_dir().join(format!("tandem-miswired-head-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for file in std::fs::read_dir(&head).unwrap() {
        let file = file.unwrap().path();
        std::fs::copy(&file, dir.join(file.file_name().unwrap())).unwrap();
    }
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["tandem_wiring"]["target"]["chat_template_sha256"] = serde_json::json!("0".repeat(64));
    std::fs::write(&config_path, config.to_string()).unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--port", "0", "--draft"])
        .arg(&dir)
        .current_dir(root)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a mis-wired head was served");
    assert!(stderr.contains("did not start"), "{stderr}");
    assert!(
        stderr.contains("chat template"),
        "the check's sentence names the template: {stderr}"
    );

    // The override starts the server (killed once it listens; a fixed shape, so it listens
    // without measuring the policy's costs first).
    let mut server = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--port", "0", "--speculation", "fixed"])
        .args(["--allow-wiring-mismatch", "--draft"])
        .arg(&dir)
        .current_dir(root)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let listening = std::io::BufReader::new(server.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .any(|l| l.contains("listening on"));
    let _ = server.kill();
    let _ = server.wait();
    assert!(listening, "the override did not start the server");
    let _ = std::fs::remove_dir_all(&dir);
}
