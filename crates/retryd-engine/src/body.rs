//! Request bodies and whether they can be sent again (step 3).

/// Whether a body can be sent again. Ordered from weakest to strongest so
/// that a multipart body is simply the minimum of its parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Replayability {
    /// Can be read only once.
    OneShot,
    /// The source can be reopened and read again.
    Reopenable,
    /// The same bytes can be sent again.
    Replayable,
}

impl Replayability {
    /// Its name in logs: `replayable`, `reopenable`, `one_shot`.
    pub fn as_str(self) -> &'static str {
        match self {
            Replayability::Replayable => "replayable",
            Replayability::Reopenable => "reopenable",
            Replayability::OneShot => "one_shot",
        }
    }
}

/// A request body, in the terms of the replayability table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    /// No body at all.
    None,
    /// An immutable byte array.
    Bytes,
    /// A value plus a deterministic codec.
    EncodedValue,
    /// A reopenable file or resource supplier.
    ReopenableSupplier,
    /// A single input stream instance.
    InputStream,
    /// A publisher factory, which declares its own replayability.
    PublisherFactory(Replayability),
    /// A publisher instance.
    Publisher,
    /// Multipart: as weak as its weakest part.
    Multipart(Vec<Body>),
}

impl Body {
    /// The replayability table of the specification.
    pub fn replayability(&self) -> Replayability {
        match self {
            Body::None | Body::Bytes | Body::EncodedValue => Replayability::Replayable,
            Body::ReopenableSupplier => Replayability::Reopenable,
            Body::InputStream | Body::Publisher => Replayability::OneShot,
            Body::PublisherFactory(declared) => *declared,
            Body::Multipart(parts) => parts
                .iter()
                .map(Body::replayability)
                .min()
                // Validation refuses an empty multipart; were one to get
                // through, it has nothing that could not be replayed.
                .unwrap_or(Replayability::Replayable),
        }
    }
}
