//! `cfg(fuzzing)` is set by cargo-fuzz (and seen by redb); on stable it is simply absent.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(fuzzing)");
}
