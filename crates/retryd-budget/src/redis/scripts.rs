//! The Lua scripts, one per operation, each run atomically by Redis.
//! The bucket scripts share the prelude `bucket.lua`.

use ::redis::Script;

const PRELUDE: &str = include_str!("bucket.lua");

/// The source of the script the exact store runs once per decision, as
/// the store runs it: for a baseline that measures the bare script.
pub const CHECK_SOURCE: &str = concat!(include_str!("bucket.lua"), "\n", include_str!("check.lua"));

/// Every script the store runs, hashed once.
pub(super) struct Scripts {
    pub(super) view: Script,
    pub(super) check: Script,
    pub(super) withdraw: Script,
    pub(super) deposit: Script,
    pub(super) set_enabled: Script,
    pub(super) acquire: Script,
    pub(super) release: Script,
    pub(super) admit: Script,
    pub(super) admit_all: Script,
    pub(super) list: Script,
    pub(super) probe: Script,
    pub(super) claim_report: Script,
    pub(super) hedge_add: Script,
    pub(super) hedge_read: Script,
}

fn bucket_script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}\n{body}"))
}

impl Scripts {
    pub(super) fn new() -> Scripts {
        Scripts {
            view: bucket_script(include_str!("view.lua")),
            check: Script::new(CHECK_SOURCE),
            withdraw: bucket_script(include_str!("withdraw.lua")),
            deposit: bucket_script(include_str!("deposit.lua")),
            set_enabled: bucket_script(include_str!("set_enabled.lua")),
            acquire: bucket_script(include_str!("acquire.lua")),
            release: bucket_script(include_str!("release.lua")),
            admit: Script::new(include_str!("admit.lua")),
            admit_all: Script::new(include_str!("admit_all.lua")),
            list: Script::new(include_str!("list.lua")),
            probe: Script::new(include_str!("probe.lua")),
            claim_report: Script::new(include_str!("claim_report.lua")),
            hedge_add: Script::new(include_str!("hedge_add.lua")),
            hedge_read: Script::new(include_str!("hedge_read.lua")),
        }
    }

    /// All of them, to load at start-up.
    pub(super) fn all(&self) -> [&Script; 14] {
        [
            &self.view,
            &self.check,
            &self.withdraw,
            &self.deposit,
            &self.set_enabled,
            &self.acquire,
            &self.release,
            &self.admit,
            &self.admit_all,
            &self.list,
            &self.probe,
            &self.claim_report,
            &self.hedge_add,
            &self.hedge_read,
        ]
    }
}
