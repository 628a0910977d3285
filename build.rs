//! Build script: the commit `tollgate --version` names.
//!
//! `TOLLGATE_COMMIT` in the build's environment wins (a container build has no `.git`); else
//! `git rev-parse` of the source tree; else `unknown`.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=TOLLGATE_COMMIT");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs");
    let commit = std::env::var("TOLLGATE_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| {
            let out = Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=TOLLGATE_COMMIT={commit}");
}
