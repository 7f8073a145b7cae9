from genqueue.consumer.launch.command import launch_command

if __name__ == "__main__":
    launch_command()
