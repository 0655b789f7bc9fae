//! The collective algorithms ask a transport what it can do (`Transport::capabilities`), never what it
//! is: no file under src/ring/ reads a transport's label or names a transport.

use std::fs;
use std::path::Path;

#[test]
fn no_algorithm_branches_on_a_transports_name() {
    let ring = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ring");
    let mut checked = 0;
    for entry in fs::read_dir(&ring).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let text = fs::read_to_string(&path).unwrap();
        for (number, line) in text.lines().enumerate() {
            for name in [".label()", ".kind()", "\"shm\"", "\"tcp\"", "\"memory\"", "\"shm+tcp\""] {
                assert!(!line.contains(name), "{}:{}: {name} in `{}`", path.display(), number + 1, line.trim());
            }
        }
        checked += 1;
    }
    assert!(checked > 5, "only {checked} files under {}", ring.display());
}
