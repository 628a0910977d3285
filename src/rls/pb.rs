//! The protocol's messages and service, generated from `proto/` by `scripts/proto.sh`.
#![allow(
    clippy::all,
    clippy::pedantic,
    clippy::nursery,
    missing_docs,
    unreachable_pub
)]

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                include!("../../proto/gen/envoy.config.core.v3.rs");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    include!("../../proto/gen/envoy.extensions.common.ratelimit.v3.rs");
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            include!("../../proto/gen/envoy.type.v3.rs");
        }
    }
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                include!("../../proto/gen/envoy.service.ratelimit.v3.rs");
            }
        }
    }
}

pub use envoy::service::ratelimit::v3::*;
