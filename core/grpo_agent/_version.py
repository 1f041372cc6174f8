"""The package version, in a leaf module so the plugin host and the CLI need not import the
package face (which re-exports the trainer)."""

__version__ = "0.1.0"
