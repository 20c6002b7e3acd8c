//! Embeds the build's identity, read by `retryd::build`: the git revision
//! (or `RETRYD_GIT_REVISION` where the source has no git directory, as in a
//! container build from a copied tree, else `unknown`) and the Cargo
//! profile. The version is Cargo's own.
//!
//! Cargo reruns this script only when HEAD or the branch it names moves, so
//! an ordinary edit-and-build cycle does not recompile the server for it.
//! It must not fail a build: without git, the revision is `unknown`.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    Some(text.trim().to_owned()).filter(|text| !text.is_empty())
}

/// Asks Cargo to rerun when `git_path` (a path inside the git directory)
/// changes; a path that does not exist would make it rerun on every build.
fn rerun_if_git_path_changes(git_path: &str) {
    if let Some(path) = git(&["rev-parse", "--git-path", git_path]) {
        if Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=RETRYD_GIT_REVISION");
    println!("cargo:rerun-if-changed=build.rs");
    let revision = match std::env::var("RETRYD_GIT_REVISION") {
        Ok(revision) if !revision.trim().is_empty() => revision.trim().to_owned(),
        _ => {
            rerun_if_git_path_changes("HEAD");
            rerun_if_git_path_changes("packed-refs");
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
                rerun_if_git_path_changes(&branch);
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
        }
    };
    // Cargo sets PROFILE to the profile a build script runs for ("debug"
    // or "release", whatever custom profile inherits from).
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".to_owned());
    println!("cargo:rustc-env=RETRYD_GIT_REVISION={revision}");
    println!("cargo:rustc-env=RETRYD_BUILD_PROFILE={profile}");
}
