"""cachetally as a program: the command line, the app, the workers, the settings, the
instance that ties the accounting to an engine, and the routes it answers itself."""
